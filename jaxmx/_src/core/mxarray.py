"""MXArray: block-quantized data plus its block scales, as a JAX pytree.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.ones((4, 40)), "mxfp8_e4m3")
    >>> q.data.shape, q.scale.shape, q.shape
    ((4, 64), (4, 2), (4, 40))
    >>> jax.tree.leaves(q)[0].dtype
    dtype(float8_e4m3fn)
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp

from jaxmx._src.core import packing
from jaxmx._src.core.blocks import format_scale_shape, padded_shape
from jaxmx._src.core.formats import Format, check_gemm_operand, get_format
from jaxmx._src.core.support import lacks


def register_pytree(cls):
    """Registers the frozen dataclass ``cls`` as a pytree (its non-static fields the leaves,
    keyed by name) whose unflatten skips ``__init__``: JAX transforms rebuild it from leaves
    that are not arrays (``None``, sentinels) or lack the leading dims ``vmap`` took off, which
    the constructor's checks would refuse. Consumers check what they get (:func:`checked`)."""
    fields = dataclasses.fields(cls)
    leaves = tuple(f.name for f in fields if not f.metadata.get("static", False))
    static = tuple(f.name for f in fields if f.metadata.get("static", False))

    def flatten_with_keys(x):
        children = [(jax.tree_util.GetAttrKey(n), getattr(x, n)) for n in leaves]
        return children, tuple(getattr(x, n) for n in static)

    def flatten(x):
        return [getattr(x, n) for n in leaves], tuple(getattr(x, n) for n in static)

    def unflatten(aux, children):
        return _unchecked(
            cls, **dict(zip(static, aux, strict=True)), **dict(zip(leaves, children, strict=True))
        )

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


def _unchecked(cls, **fields):
    """An instance of the frozen dataclass ``cls`` with ``fields``, without its constructor's
    checks (for fields already checked, or rebuilt by a JAX transform)."""
    x = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(x, name, value)
    return x


@register_pytree
@dataclasses.dataclass(frozen=True, init=False)
class MXArray:
    """A tensor quantized in blocks along one axis, or in 2-D tiles of its last two axes.

    ``MXArray(data, scale, fmt, axis, shape, tile=None, global_scale=None)`` takes the codes;
    it holds them packed where the format's codes are narrower than a byte
    (:attr:`Format.packing`: 4-bit codes two per byte, FP6 four per three bytes, along the block
    axis; :mod:`jaxmx._src.core.packing`). :meth:`from_held` takes the held form.

    Attributes:
        held: the codes as the device holds them (the pytree leaf): ``data`` itself for 8-bit
            and wider codes, ``uint8`` groups along ``axis`` for 4-bit and FP6 codes.
        data: element codes (read from ``held``), the logical shape padded along ``axis`` to a
            multiple of the block (with ``tile``, the last two axes to multiples of the tile);
            padding codes are zero and consumers ignore them.
        scale: the block scales (the format's ``scale_dtype``: ``float8_e8m0fnu`` or
            ``float32``); ``data``'s shape with ``axis`` divided by the block (with ``tile``, the
            last two axes divided by the tile's sides). Per-row formats: ``axis`` of size 1;
            per-tensor formats: all ones.
        fmt: the format name (static).
        axis: the block axis (static; stored non-negative, a negative one counts from the end
            as :func:`jaxmx.quantize`'s does); with ``tile``, the last axis.
        shape: the logical, unpadded shape (static).
        tile: ``None`` (1-D blocks along ``axis``) or ``(rows, cols)``: one scale per tile of the
            last two axes (static).
        global_scale: NVFP4 only: the float32 per-tensor scale ``g`` (a value is
            ``code * scale * g``), shape ``()``; ``None`` for every other format.

    Under ``vmap`` the leaves may carry extra leading dimensions that ``shape`` does not list
    (the same for codes and scales), and traced leaves may lack leading dimensions that it
    lists (an MXArray built outside ``vmap`` and mapped over). The constructor checks the
    fields against each other and raises a TypeError or ValueError naming the one at fault;
    every jaxmx function that consumes an MXArray checks it again (:func:`checked`), so one
    rebuilt from other leaves raises instead of giving wrong numbers.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> q = jaxmx.quantize(jnp.ones((4, 64)))
        >>> jaxmx.MXArray(q.data[0], q.scale[0], q.fmt, q.axis, (4, 64))
        Traceback (most recent call last):
        ...
        ValueError: MXArray: an MXArray of logical shape (4, 64) ... got codes (64,) and scales (2,)
        >>> p = jaxmx.quantize(jnp.ones((4, 64)), "mxfp4")
        >>> p.data.shape, p.held.shape, p.held.dtype, p.nbytes
        ((4, 64), (4, 32), dtype('uint8'), 136)
    """

    held: jax.Array
    scale: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    tile: tuple[int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))
    global_scale: jax.Array | None = None

    def __init__(
        self,
        data=None,
        scale=None,
        fmt=None,
        axis=None,
        shape=None,
        tile=None,
        global_scale=None,
        *,
        held=None,
    ):
        if (data is None) == (held is None):
            raise TypeError(
                "MXArray: give the codes (data) or their held form (held=), one of the two "
                "(dataclasses.replace(q, data=...) passes both: replace held=, or construct)"
            )
        given = data if held is None else held
        fields = _checked(
            given, scale, fmt, axis, shape, tile, global_scale, "MXArray", held=held is not None
        )
        f = get_format(fields[0])
        if held is None:
            axis = fields[1] - len(fields[2])  # from the end: leaves may have more leading dims
            held = packing.pack(jnp.asarray(data), f, axis=axis) if f.packing else data
        values = dict(zip(("fmt", "axis", "shape", "tile"), fields, strict=True))
        for name, value in dict(values, held=held, scale=scale, global_scale=global_scale).items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_held(cls, held, scale, fmt, axis, shape, tile=None, global_scale=None) -> MXArray:
        """The MXArray that holds ``held`` (:attr:`held`'s form: packed codes for 4-bit and FP6
        formats), checked as the constructor checks codes (``MXArray(held=...)`` alike).

        Example:
            >>> import jax.numpy as jnp, jaxmx
            >>> q = jaxmx.quantize(jnp.ones((2, 32)), "mxfp4")
            >>> r = jaxmx.MXArray.from_held(q.held, q.scale, "mxfp4", 1, (2, 32))
            >>> bool((jaxmx.dequantize(r) == 1).all())
            True
        """
        return cls(None, scale, fmt, axis, shape, tile, global_scale, held=held)

    @property
    def data(self) -> jax.Array:
        """The element codes (``dtype`` of the format), unpacked from :attr:`held` where the
        format packs them."""
        f = self.format
        if f.packing is None:
            return self.held
        return packing.unpack(jnp.asarray(self.held), f, axis=self.axis - self.ndim)

    @property
    def format(self) -> Format:
        """The :class:`~jaxmx.Format` of the elements."""
        return get_format(self.fmt)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def data_axis(self) -> int:
        """The index of the block axis among the axes of ``data`` (which may have more or fewer
        leading dims than ``shape`` under ``vmap``)."""
        return self.axis + self.scale.ndim - self.ndim

    @property
    def nbytes(self) -> int:
        """Bytes the device holds: the held codes (packed for 4-bit and FP6 formats), the
        scales and the NVFP4 tensor scale."""
        scales = self.scale.size * self.scale.itemsize
        if self.global_scale is not None:
            scales += self.global_scale.size * 4
        return self.held.size * jnp.dtype(self.held.dtype).itemsize + scales

    def __jax_array__(self):
        raise TypeError(
            f"an {self.fmt} MXArray holds codes and block scales, not values: "
            "jaxmx.dequantize(q) gives the array (jnp.asarray cannot)"
        )

    def __repr__(self) -> str:
        tile = f", tile={self.tile}" if self.tile else ""
        return f"MXArray(fmt={self.fmt!r}, shape={self.shape}, axis={self.axis}{tile})"


def check_gemm_pair(a: MXArray, b: MXArray, where: str) -> None:
    """Two checked GEMM operands, each blocked along K, in formats a GEMM takes: the same K and
    the same batch dims."""
    check_gemm_operand(a.format, f"{where}: a")
    check_gemm_operand(b.format, f"{where}: b")
    if a.shape[a.axis] != b.shape[b.axis]:
        raise ValueError(
            f"{where}: contracting sizes differ: a has K = {a.shape[a.axis]}, b has "
            f"K = {b.shape[b.axis]}"
        )
    if a.scale.shape[:-2] != b.scale.shape[:-2]:
        raise ValueError(
            f"{where}: batch dimensions differ: a {a.scale.shape[:-2]} vs b "
            f"{b.scale.shape[:-2]} (shapes {a.shape} and {b.shape})"
        )


def checked(q, where: str) -> MXArray:
    """``q`` with ``jax.Array`` leaves, after checking that its fields agree with each other
    (:func:`checked_fields`; a TypeError or ValueError naming ``where`` and the field at fault).

    ``q`` may come from a pytree unflatten, which skips the constructor's checks.
    """
    if not isinstance(q, MXArray):
        raise TypeError(f"{where}: expected an MXArray, got {type(q).__name__}")
    fmt, axis, shape, tile = checked_fields(q, where)
    g = None if q.global_scale is None else jnp.asarray(q.global_scale)
    held, scale = jnp.asarray(q.held), jnp.asarray(q.scale)
    return _unchecked(  # checked above, naming `where`: the constructor would check again
        MXArray, held=held, scale=scale, fmt=fmt, axis=axis, shape=shape, tile=tile, global_scale=g
    )


def checked_fields(q, where: str) -> tuple[str, int, tuple[int, ...], tuple | None]:
    """``(format name, axis, shape, tile)`` of the MXArray (its held codes) or GridArray (its
    element values) ``q`` after checking that its fields agree with each other, else a TypeError
    or ValueError naming ``where`` and the field at fault (:func:`_checked`)."""
    if isinstance(q, MXArray):
        leaves = (q.held, q.scale, q.fmt, q.axis, q.shape, q.tile, q.global_scale)
        return _checked(*leaves, where, held=True)
    leaves = (q.data, q.scale, q.fmt, q.axis, q.shape, None, q.global_scale)
    return _checked(*leaves, where, values=True)


def _checked(
    data, scale, fmt, axis, shape, tile, global_scale, where: str, *, held=False, values=False
) -> tuple[str, int, tuple[int, ...], tuple | None]:
    """``(format name, axis, shape, tile)`` after checking the fields of an MXArray against
    each other: the format, the axis, the logical shape, the dtypes of codes and scales, and the
    shapes of codes and scales (which may have extra leading dimensions, the same for both, as
    under ``vmap``; traced leaves may also lack leading dimensions, as inside ``vmap``). ``data``
    holds codes, the held codes (``held``: packed where the format packs) or float32 element
    values (``values``: a GridArray, without tile)."""
    f = get_format(fmt)
    shape = _shape(shape, where)
    if isinstance(axis, bool) or not _is_index(axis) or not -len(shape) <= axis < len(shape):
        raise ValueError(f"{where}: MXArray axis {axis!r} is not an axis of shape {shape}")
    axis = operator.index(axis) % len(shape)  # -1: the last, as quantize takes it
    data_shape, data_dtype = _shape_and_dtype(data, "data", where)
    scale_shape_, scale_dtype = _shape_and_dtype(scale, "scale", where)
    kind = "GridArray" if values else "MXArray"
    if values:
        elements, what = jnp.float32, "values"
    elif held and f.packing:
        elements, what = packing.held_dtype(f), "packed codes"
    else:
        elements, what = f.dtype, "codes"
    if data_dtype != elements:
        raise TypeError(
            f"{where}: an {f.name} {kind} holds {jnp.dtype(elements)} {what}, got {data_dtype}"
        )
    if scale_dtype != f.scale_dtype:
        raise TypeError(
            f"{where}: {f.name} MXArray scales must be {f.scale_dtype}, got {scale_dtype}"
        )
    tile = check_tile(tile, len(shape), where)
    if tile is not None and axis != len(shape) - 1:
        raise ValueError(f"{where}: a tiled MXArray has axis {len(shape) - 1}, got {axis}")
    if tile is not None and (missing := lacks(f, "tiles")):
        raise ValueError(f"{where}: an {f.name} MXArray ({missing}) has no tile")
    want_data = padded_shape(shape, axis, f.block, tile)
    if not values:
        want_data = _held_or_codes(want_data, f, axis - len(shape), held, where)
    want_scale = format_scale_shape(f, shape, axis, tile)
    # Under vmap the leaves gain leading dims, or, traced, lose the logical shape's leading dims
    # (an MXArray built outside and vmapped over): compare the trailing dims, block axis included.
    ndim = len(data_shape)
    n = min(ndim, len(shape))
    traced = any(isinstance(x, jax.core.Tracer) for x in (data, scale))
    consistent = (
        (ndim >= len(shape) or traced)
        and len(shape) - axis <= n  # the block axis is among the leaves' dims
        and ndim == len(scale_shape_)
        and data_shape[: ndim - n] == scale_shape_[: ndim - n]
        and data_shape[ndim - n :] == want_data[len(shape) - n :]
        and scale_shape_[ndim - n :] == want_scale[len(shape) - n :]
    )
    if not consistent:
        shaped = "packed codes" if held and f.packing else "codes"
        raise ValueError(
            f"{where}: an MXArray of logical shape {shape} blocked along axis {axis}"
            f"{f' in {tile} tiles' if tile else ''} holds "
            f"{shaped} of shape {want_data} and scales of shape {want_scale} (give or take "
            f"leading batch dims), got {shaped} {data_shape} and scales {scale_shape_}"
        )
    _check_global_scale(global_scale, f, data_shape[: ndim - n], where)
    return f.name, axis, shape, tile


def _held_or_codes(padded: tuple[int, ...], f, axis: int, held: bool, where: str):
    """The shape of the held codes (``held``) or of the codes of ``padded`` shape; a
    ValueError naming ``where`` where the format's groups do not fit the block axis."""
    try:
        shape = packing.held_shape(padded, f, axis)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return shape if held else padded


def _shape_and_dtype(x, name: str, where: str) -> tuple[tuple[int, ...], jnp.dtype]:
    """``(shape, dtype)`` of an array-like leaf (a jax or numpy array, a tracer, a
    ``jax.ShapeDtypeStruct``), or a TypeError naming the field ``name``."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{where}: MXArray {name} must be an array, got {type(x).__name__}")
    return tuple(x.shape), jnp.dtype(x.dtype)


def _check_global_scale(g, f: Format, batch: tuple[int, ...], where: str) -> None:
    """NVFP4: ``g`` must be float32, shaped like the leaves' extra leading dims; other formats:
    ``None``."""
    if not f.has_global_scale:
        if g is not None:
            raise ValueError(f"{where}: an {f.name} MXArray has no global_scale, got one")
        return
    if g is None:
        raise ValueError(f"{where}: an {f.name} MXArray needs its float32 global_scale, got None")
    shape, dtype = _shape_and_dtype(g, "global_scale", where)
    if dtype != jnp.float32 or shape != batch:
        raise TypeError(
            f"{where}: an {f.name} MXArray's global_scale must be float32 of shape {batch}, got "
            f"{dtype}{shape}"
        )


def check_tile(tile, ndim: int, where: str) -> tuple[int, int] | None:
    """``tile`` as a pair of positive sizes (or ``None``), for an array of rank ``ndim``."""
    if tile is None:
        return None
    try:
        rows, cols = (operator.index(t) for t in tile)
    except (TypeError, ValueError):
        raise ValueError(
            f"{where}: tile must be a pair of sizes (rows, cols), got {tile!r}"
        ) from None
    if rows < 1 or cols < 1:
        raise ValueError(f"{where}: tile sizes must be positive, got {tile!r}")
    if ndim < 2:
        raise ValueError(f"{where}: 2-D tiles need an array of rank >= 2, got rank {ndim}")
    return rows, cols


def _shape(shape, where: str) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if dims is None or not all(_is_index(d) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"{where}: MXArray shape must be a tuple of sizes, got {shape!r}")
    return tuple(operator.index(d) for d in dims)


def _is_index(x) -> bool:
    try:
        operator.index(x)
    except TypeError:
        return False
    return True
