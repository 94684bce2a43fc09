"""Whole MX blocks per shard: a sharded reduction axis must split into whole quantization blocks.

A quantization block (32 consecutive elements along a reduction axis) must not straddle two
devices. jaxmx checks this wherever the sharding is known:

- while tracing, for arrays whose type carries their sharding (mesh axes of type ``Explicit``,
  the default of ``jax.make_mesh``): :func:`check_block_alignment` raises
  :class:`BlockShardingError` before anything is compiled;
- in the native GEMM's partitioning rule, for ``Auto`` mesh axes, once XLA has chosen the
  shardings (XLA then reports the error inside its compile error).

The emulated GEMM needs no check under ``Auto`` axes: XLA partitions it itself, and a block that
does not fit a shard is gathered, never split.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core.block_sharding import (
    ...     BlockShardingError, ReducedAxis, check_block_alignment)
    >>> check_block_alignment(jnp.ones((4, 64)), "example()", "x", (ReducedAxis(1, "K"),), 32)
    >>> issubclass(BlockShardingError, ValueError)
    True
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax._src import sharding_impls
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class BlockShardingError(ValueError):
    """A sharding splits an MX quantization block (32 elements along a reduction axis)."""


@dataclasses.dataclass(frozen=True)
class ReducedAxis:
    """An axis of an operand that a GEMM reduces, described for the error message.

    Attributes:
        axis: its index in the operand.
        name: a short name, e.g. ``"K"``.
        role: what the axis is, e.g. ``"the contracting dimension"``.
        fix: an extra hint appended to the message.
    """

    axis: int
    name: str
    role: str = ""
    fix: str = ""


def check_block_alignment(
    x: jax.Array, where: str, tensor: str, axes: tuple[ReducedAxis, ...], block: int
) -> None:
    """Raises :class:`BlockShardingError` if ``x``'s type shards one of ``axes`` mid-block.

    Args:
        x: an array (or tracer) about to be quantized along each of ``axes``.
        where, tensor: names for the message (the API called, and which operand ``x`` is).
        axes: the reduction axes of ``x`` to check.
        block: the quantization block size.

    Only shardings carried by the type (``Explicit`` mesh axes, or a concrete array's own
    sharding) are seen here; inside ``shard_map`` arrays are per-device blocks.
    """
    sharding = named_sharding(x)
    for d in axes:
        message = merged_axis_problem(sharding, x.shape, (d.axis,), where, tensor, d, block)
        if message:
            raise BlockShardingError(message)


def named_sharding(x) -> NamedSharding | None:
    """The sharding ``x``'s type carries (Explicit axes), else a concrete array's own, or None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
        sharding = getattr(x, "sharding", None)  # a concrete, committed array
    return sharding if isinstance(sharding, NamedSharding) else None


def merged_axis_problem(
    sharding: NamedSharding | None,
    shape: tuple[int, ...],
    group: tuple[int, ...],
    where: str,
    tensor: str,
    d: ReducedAxis,
    block: int,
) -> str | None:
    """Why the dims ``group`` of an array, merged (major to minor) into one reduction axis, put a
    block on two devices under ``sharding``; None when every shard holds whole blocks.

    A dim of size ``s`` split ``n`` ways inside the merged axis puts shard boundaries every
    ``s / n * (product of the dims after it)`` elements; each such stride must be a multiple of
    ``block``.
    """
    if sharding is None:
        return None
    size, names, shard_count, aligned = math.prod(shape[i] for i in group), (), 1, True
    for j, axis in enumerate(group):
        axis_names, n = shards(sharding, axis)
        if n == 1:
            continue
        names, shard_count = names + axis_names, shard_count * n
        minor = math.prod(shape[i] for i in group[j + 1 :])
        aligned &= shape[axis] % n == 0 and (shape[axis] // n * minor) % block == 0
    if aligned:
        return None
    return misaligned_message(where, tensor, d, size, names, shard_count, block)


def shards(sharding: NamedSharding, axis: int) -> tuple[tuple[str, ...], int]:
    """(mesh axis names, number of shards) of array axis ``axis`` under ``sharding``."""
    spec = sharding.spec
    names = mesh_axes(spec[axis]) if axis < len(spec) else ()
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
    return names, math.prod(sizes[a] for a in names)


def mesh_axes(entry) -> tuple[str, ...]:
    """The mesh axis names of one ``PartitionSpec`` entry."""
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def misaligned_message(
    where: str, tensor: str, d: ReducedAxis, size: int, axes, n: int, block: int
) -> str:
    """The text of a :class:`BlockShardingError`."""
    over = f"mesh axes {tuple(axes)}" if len(axes) != 1 else f"mesh axis {axes[0]!r}"
    per = f"{size / n:g}" if size % n else f"{size // n}"
    role = f"; {d.role}" if d.role else ""
    text = (
        f"{where}: {tensor} axis {d.name} (size {size}{role}) is sharded over {over} into "
        f"{n} shards of {per} elements, so MX quantization blocks ({block} consecutive "
        "elements along a reduction axis) would straddle shard boundaries. Make the per-shard "
        f"size a multiple of {block} ({d.name} a multiple of {block} x {n} = "
        f"{block * n}), shard this dimension over fewer devices, or leave it unsharded"
    )
    return text + (f" ({d.fix})." if d.fix else ".")


def _decoded_spec(sharding, mesh) -> tuple:
    """The ``PartitionSpec`` entries of a sharding XLA hands a ``custom_partitioning`` rule
    (a GSPMD sharding, not a ``NamedSharding``) over ``mesh``.

    JAX has no public API for this decode: its own partitioning rules use this private one
    (``jax._src.sharding_impls.parse_flatten_op_sharding``), pinned by the SPMD tests
    (tests/test_spmd.py). The one ``jax._src`` use in jaxmx; tests/test_layers.py allows it here
    only.
    """
    return tuple(sharding_impls.parse_flatten_op_sharding(sharding._hlo_sharding, mesh)[0])


def spec_of(shape, mesh, where: str, block: int) -> tuple:
    """The ``PartitionSpec`` entries of an argument's (undecoded) sharding, one per dimension."""
    sharding = getattr(shape, "sharding", None)
    ndim = len(shape.shape)
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
    elif sharding is None:
        spec = ()
    else:
        try:
            spec = _decoded_spec(sharding, mesh)
        except Exception:  # split over mesh sub-axes: a dimension not divisible by its shards
            raise BlockShardingError(
                f"{where}: an operand of shape {tuple(shape.shape)} is sharded into pieces that "
                f"do not divide its dimensions ({sharding}); a sharded K must hold whole "
                f"{block}-element blocks per device. Make K a multiple of {block} x the number "
                "of shards, or leave it unsharded."
            ) from None
    return spec + (None,) * (ndim - len(spec))
