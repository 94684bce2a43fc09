"""One Adam moment stored in a chosen format: its encode (inside the update), decode and zeros.

Formats (``MOMENT_FORMATS``), bytes per element of a moment:

- ``"float32"`` (4), ``"bfloat16"`` (2, rounded to nearest): :class:`DenseMoment`;
- ``"8bit"`` (1 + 4 / 256): a code map (the signed dynamic map for the first moment, the unsigned
  one for the second, :mod:`code_maps`) with a float32 absmax scale per block of 256;
- ``"fp8"`` (1 + 4 / 256): FP8 E4M3 codes with a float32 scale ``absmax / 448`` per block of 256;
- ``"4bit"`` (1 / 2 + 4 / 128): 4-bit codes of a code map (the signed 4-bit dynamic map, the
  unsigned linear one), two per byte, with a float32 absmax scale per block of 128.

The block-scaled formats are :class:`BlockMoment`. A block is ``block`` consecutive elements of the
parameter in its own row-major order, taken from its trailing axes: :func:`block_axis` is the
first axis of the shortest run of trailing axes whose element count is a multiple of ``block``
(the last axis when it divides). Its scales have the shape ``shape[:axis] + (blocks,)``, so a
parameter sharded on an axis before ``axis``, or on ``axis`` in whole blocks per shard, keeps
each block on one device (:func:`zeros` checks it and places the moment like its parameter).

A parameter with fewer than ``min_size`` elements, or whose element count is not a multiple of
the block, keeps this moment in float32 (a :class:`DenseMoment` whose ``note`` says why).

Example:
    >>> import jax.numpy as jnp
    >>> m = zeros(jnp.ones((16, 512)), "8bit", signed=True, block=256, min_size=4096)
    >>> m.codes.shape, m.codes.dtype, m.scales.shape
    ((16, 512), dtype('uint8'), (16, 2))
    >>> x = jnp.linspace(-1.0, 1.0, 16 * 512).reshape(16, 512)
    >>> float(jnp.abs(decode(encode(x, m)) - x).max()) < 0.02
    True
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmx._src.core.block_sharding import BlockShardingError, shards
from jaxmx._src.core.reductions import max_along
from jaxmx._src.optim import code_maps

MOMENT_FORMATS = ("float32", "bfloat16", "8bit", "fp8", "4bit")
BLOCK_FORMATS = ("8bit", "fp8", "4bit")
DEFAULT_BLOCKS = {"8bit": 256, "fp8": 256, "4bit": 128}
FP8_MAX = 448.0
MIN_SCALE = 1e-12  # an all-zero block's absmax, so that its scaled values are 0, not NaN


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseMoment:
    """A moment held as plain values of the parameter's shape.

    Attributes:
        values: float32 or bfloat16.
        format: ``"float32"`` or ``"bfloat16"``.
        note: why a moment asked for in a block format is float32 instead; empty otherwise.
        name: the parameter's path.
    """

    values: jax.Array
    format: str = dataclasses.field(metadata=dict(static=True))
    note: str = dataclasses.field(default="", metadata=dict(static=True))
    name: str = dataclasses.field(default="", metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMoment:
    """A moment held as codes and one float32 scale per block.

    Attributes:
        codes: ``uint8`` (``"8bit"``; the parameter's shape), ``float8_e4m3fn`` (``"fp8"``; the
            parameter's shape) or ``uint8`` two codes per byte, the first of a pair in the high
            nibble (``"4bit"``; ``shape[:axis] + (trailing elements / 2,)``).
        scales: float32, ``shape[:axis] + (blocks,)``.
        format: ``"8bit"``, ``"fp8"`` or ``"4bit"``.
        signed: the code map is the signed one (a first moment).
        shape: the parameter's shape.
        axis: the first of the trailing axes the blocks run over (:func:`block_axis`).
        block: elements per block.
        name: the parameter's path.
    """

    codes: jax.Array
    scales: jax.Array
    format: str = dataclasses.field(metadata=dict(static=True))
    signed: bool = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    block: int = dataclasses.field(metadata=dict(static=True))
    name: str = dataclasses.field(default="", metadata=dict(static=True))


Moment = DenseMoment | BlockMoment


def check_format(name: str, argument: str = "") -> str:
    """``name`` if it is one of :data:`MOMENT_FORMATS`, else a ValueError naming the argument
    (default ``state_format``) and the choices."""
    if name not in MOMENT_FORMATS:
        raise ValueError(
            f"unknown moment format {name!r} ({argument or 'state_format'}); "
            f"expected one of {MOMENT_FORMATS}"
        )
    return name


def block_axis(shape: tuple[int, ...], block: int) -> int | None:
    """The first axis of the shortest run of trailing axes of ``shape`` whose element count is a
    multiple of ``block``; None if the whole shape's is not.

    Example:
        >>> block_axis((16, 512), 256), block_axis((512, 128), 256), block_axis((3, 100), 256)
        (1, 0, None)
    """
    for axis in range(len(shape) - 1, -1, -1):
        if math.prod(shape[axis:]) % block == 0:
            return axis
    return None


def table(fmt: str, signed: bool) -> np.ndarray:
    """The code map of a map format (``"8bit"``, ``"4bit"``) for a signed or unsigned moment."""
    if fmt == "8bit":
        return code_maps.DYNAMIC_8BIT_SIGNED if signed else code_maps.DYNAMIC_8BIT_UNSIGNED
    return code_maps.DYNAMIC_4BIT_SIGNED if signed else code_maps.LINEAR_4BIT_UNSIGNED


def dense_note(shape: tuple[int, ...], block: int, min_size: int) -> str:
    """Why a parameter of ``shape`` keeps block-format moments in float32; empty if it does not."""
    size = math.prod(shape)
    if size < min_size:
        return f"{size} elements, below min_size={min_size}"
    if size % block:
        return f"{size} elements, not a multiple of the block ({block})"
    return ""


def zeros(param, fmt: str, *, signed: bool, block: int, min_size: int, name: str = "") -> Moment:
    """The zero moment of ``param`` (an array or a ShapeDtypeStruct) in format ``fmt``, placed
    like a concrete ``param``; ``name`` (the parameter's path) goes into error messages.

    Raises:
        BlockShardingError: ``param`` is sharded so that a block would straddle two devices.
    """
    shape = tuple(param.shape)
    if fmt in ("float32", "bfloat16"):
        return DenseMoment(_placed(jnp.zeros(shape, fmt), param, P), fmt, name=name)
    note = dense_note(shape, block, min_size)
    if note:
        values = _placed(jnp.zeros(shape, jnp.float32), param, P)
        return DenseMoment(values, "float32", note, name)
    axis = block_axis(shape, block)
    spec = _scale_spec(param, shape, axis, block, fmt, name)
    trailing = math.prod(shape[axis:])
    if fmt == "4bit":
        codes = jnp.zeros((*shape[:axis], trailing // 2), jnp.uint8)
        codes = _placed(codes, param, spec)
    else:
        dtype = jnp.uint8 if fmt == "8bit" else jnp.float8_e4m3fn
        codes = _placed(jnp.zeros(shape, dtype), param, P)
    scales = _placed(jnp.zeros((*shape[:axis], trailing // block), jnp.float32), param, spec)
    return BlockMoment(codes, scales, fmt, signed, shape, axis, block, name)


def _scale_spec(param, shape, axis, block, fmt, name) -> P | None:
    """The PartitionSpec of the scales (and packed 4-bit codes) of a sharded ``param``: its own
    up to ``axis``, then ``axis``'s for the block axis; None if ``param`` has no NamedSharding."""
    sharding = getattr(param, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    for i in range(axis, len(shape)):
        names, n = shards(sharding, i)
        if n == 1:
            continue
        minor = math.prod(shape[i + 1 :])
        if i > axis or shape[i] % n or (shape[i] // n * minor) % block:
            raise BlockShardingError(
                f"optimizer state of {name or 'a parameter'} (shape {shape}, sharding "
                f"{sharding.spec}): its {fmt} moments take blocks of {block} consecutive elements "
                f"over axes {tuple(range(axis, len(shape)))}, and sharding axis {i} over "
                f"{n} devices ({names}) splits a block across devices. Shard another axis, "
                f"shard axis {i} over a device count that leaves whole blocks "
                f"(({shape[i]} / devices) * {minor} a multiple of {block}), pass a block_size "
                "that divides each shard, or keep this parameter's moments in bfloat16 "
                "(per-parameter formats: optax.partition)."
            )
    return P(*spec[:axis], spec[axis])


def _placed(x: jax.Array, param, spec) -> jax.Array:
    """``x`` put on ``param``'s devices: with ``spec`` (P: ``param``'s own spec) if ``param`` has
    a NamedSharding, on its sharding if that is a single device or replicated; as it is for a
    tracer or a ShapeDtypeStruct."""
    sharding = getattr(param, "sharding", None)
    if sharding is None or isinstance(param, jax.core.Tracer):
        return x
    if isinstance(sharding, NamedSharding):
        spec = sharding.spec if spec is P else spec
        return jax.device_put(x, NamedSharding(sharding.mesh, spec))
    if sharding.is_fully_replicated:
        return jax.device_put(x, sharding)
    raise ValueError(f"cannot place an optimizer moment like a parameter sharded by {sharding}")


def decode(m: Moment) -> jax.Array:
    """The float32 values of a stored moment."""
    if isinstance(m, DenseMoment):
        return m.values.astype(jnp.float32)
    lead = m.shape[: m.axis]
    blocks = (*lead, m.scales.shape[-1], m.block)
    if m.format == "fp8":
        codes = m.codes.astype(jnp.float32).reshape(blocks)
    else:
        codes = m.codes
        if m.format == "4bit":
            codes = jnp.stack([codes >> 4, codes & 0xF], axis=-1)
        codes = jnp.asarray(table(m.format, m.signed))[codes.astype(jnp.int32).reshape(blocks)]
    return (codes * m.scales[..., None]).reshape(m.shape)


def encode(x: jax.Array, like: Moment) -> Moment:
    """``x`` (float32, the parameter's shape) stored in ``like``'s format and layout."""
    if isinstance(like, DenseMoment):
        return dataclasses.replace(like, values=x.astype(like.values.dtype))
    lead = like.shape[: like.axis]
    blocks = x.reshape((*lead, -1, like.block))
    absmax = jnp.maximum(max_along(jnp.abs(blocks), -1), MIN_SCALE)
    scales = divide(absmax, jnp.float32(FP8_MAX)) if like.format == "fp8" else absmax
    scaled = divide(blocks, scales[..., None])
    if like.format == "fp8":
        codes = scaled.astype(jnp.float8_e4m3fn).reshape(like.shape)
    else:
        codes = code_maps.quantize_to_map(scaled, table(like.format, like.signed))
        if like.format == "4bit":
            pairs = codes.reshape((*lead, -1, 2))
            codes = (pairs[..., 0] << 4) | pairs[..., 1]
        else:
            codes = codes.reshape(like.shape)
    return dataclasses.replace(like, codes=codes, scales=scales)


def divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a / b`` (``b`` broadcast to ``a``'s shape) rounded once. XLA rewrites a division by a
    broadcast into a multiplication by the rounded reciprocal (two roundings, a different scale
    or code near a tie); the barrier hands it a full-shape divisor instead."""
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(b, a.shape))


def nbytes(m: Moment) -> int:
    """Device bytes of a stored moment (its arrays' ``nbytes``)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(m))
