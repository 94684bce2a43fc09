"""How an MXArray holds its codes on the device: 4-bit codes two per byte, FP6 codes four per
three bytes, along the block axis; every other format one code per element of its ``dtype``.

A group of :attr:`Format.packing` consecutive codes along the block axis (padded to whole
blocks, so groups never straddle the end) becomes that many bytes:

- 4-bit (MXFP4, NVFP4): code ``2i`` in the low nibble of byte ``i``, code ``2i + 1`` in its high
  nibble (CUDA's ``__nv_fp4x2`` order, and the one of gpt-oss's ``*_blocks`` when the block
  axis is the last).
- FP6 (MXFP6 E2M3 / E3M2): codes ``4i .. 4i + 3`` (6 bits each) form the little-endian 24-bit
  word ``c0 | c1 << 6 | c2 << 12 | c3 << 18`` held in bytes ``3i .. 3i + 2``.

The other axes keep their sizes, so an MXArray's held codes shard, slice and stack along them
as its codes would. Axes are counted from the end (``axis < 0``), so leaves with extra leading
dims (``vmap``) pack and unpack alike.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core.formats import get_format
    >>> codes = jnp.array([[1.0, -0.5], [6.0, 0.0]], jnp.float4_e2m1fn)
    >>> held = pack(codes, get_format("mxfp4"), axis=-2)   # along the first of two axes
    >>> held.dtype, held.shape, held.tolist()
    (dtype('uint8'), (1, 2), [[114, 9]])
    >>> (unpack(held, get_format("mxfp4"), axis=-2) == codes).all().item()
    True
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core.formats import Format

_SIX_BITS = 0x3F


def held_dtype(f: Format) -> jnp.dtype:
    """The dtype an MXArray of format ``f`` holds its codes in: ``uint8`` where the codes are
    packed, else the codes' own ``dtype``."""
    return jnp.dtype(jnp.uint8 if f.packing else f.dtype)


def held_shape(shape: tuple[int, ...], f: Format, axis: int) -> tuple[int, ...]:
    """The shape that holds codes of ``shape`` (``axis``, negative, counted from the end): the
    block axis scaled by bytes per code where ``f`` packs, else ``shape`` itself. A ValueError
    if that axis is not a whole number of groups.

    Example:
        >>> from jaxmx._src.core.formats import get_format
        >>> held_shape((64, 8), get_format("mxfp6_e2m3"), axis=-2)
        (48, 8)
    """
    if f.packing is None:
        return tuple(shape)
    codes, held = f.packing
    n = shape[axis]
    if n % codes:
        raise ValueError(
            f"{f.name} packs {codes} codes into {held} byte{'s' * (held > 1)} along the block "
            f"axis; its padded length {n} is not a multiple of {codes} (give 2-D tiles a width "
            "that is)"
        )
    out = list(shape)
    out[axis] = n // codes * held
    return tuple(out)


def pack(codes: jax.Array, f: Format, *, axis: int) -> jax.Array:
    """The held form of ``codes`` (the format's ``dtype``) along ``axis`` (negative): see the
    module docstring. ``codes`` itself for formats that do not pack. Eager calls run one
    compiled program per shape and packing (MXFP4 and NVFP4 share theirs), not one per
    operation."""
    if f.packing is None:
        return codes
    held_shape(codes.shape, f, axis)  # refuses a partial group, naming the format
    return _pack(codes, group=f.packing[0], axis=axis)


@functools.partial(jax.jit, static_argnames=("group", "axis"))
def _pack(codes: jax.Array, *, group: int, axis: int) -> jax.Array:
    n = codes.shape[axis]
    split = _split(codes, axis, n // group, group)  # [..., groups, group, ...]
    bits = lax.bitcast_convert_type(split, jnp.uint4) if group == 2 else split  # 4-bit codes
    c = [_take(bits, i, axis).astype(jnp.uint32) for i in range(group)]
    if group == 2:
        return (c[0] | (c[1] << 4)).astype(jnp.uint8)
    word = c[0] | (c[1] << 6) | (c[2] << 12) | (c[3] << 18)
    held = [(word >> shift) & 0xFF for shift in (0, 8, 16)]
    return _merge(jnp.stack(held, axis=axis).astype(jnp.uint8), axis)


def unpack(held: jax.Array, f: Format, *, axis: int) -> jax.Array:
    """The codes (the format's ``dtype``) that :func:`pack` held as ``held``, along ``axis``
    (one compiled program per shape and packing, as :func:`pack`)."""
    if f.packing is None:
        return held
    return _unpack(held, packing=f.packing, dtype=jnp.dtype(f.dtype), axis=axis)


@functools.partial(jax.jit, static_argnames=("packing", "dtype", "axis"))
def _unpack(held: jax.Array, *, packing: tuple[int, int], dtype, axis: int) -> jax.Array:
    group, size = packing
    if group == 2:
        byte = held.astype(jnp.uint8)
        parts = [(byte & 0xF).astype(jnp.uint4), (byte >> 4).astype(jnp.uint4)]
        codes = _merge(jnp.stack(parts, axis=axis), axis)
        return lax.bitcast_convert_type(codes, dtype)
    triples = _split(held.astype(jnp.uint32), axis, held.shape[axis] // size, size)
    b = [_take(triples, i, axis) for i in range(size)]
    word = b[0] | (b[1] << 8) | (b[2] << 16)
    parts = [(word >> shift) & _SIX_BITS for shift in (0, 6, 12, 18)]
    return _merge(jnp.stack(parts, axis=axis), axis).astype(dtype)


def _split(x: jax.Array, axis: int, groups: int, group: int) -> jax.Array:
    """``x`` with ``axis`` (negative) split into ``[groups, group]``: the group at ``axis``."""
    axis %= x.ndim
    return x.reshape(*x.shape[:axis], groups, group, *x.shape[axis + 1 :])


def _take(x: jax.Array, i: int, axis: int) -> jax.Array:
    """Element ``i`` of ``x`` along ``axis`` (negative), that axis dropped."""
    return lax.index_in_dim(x, i, axis % x.ndim, keepdims=False)


def _merge(x: jax.Array, axis: int) -> jax.Array:
    """``x`` with the axis just before ``axis`` (negative: a group stacked there) and ``axis``
    merged into one."""
    axis %= x.ndim
    return x.reshape(*x.shape[: axis - 1], x.shape[axis - 1] * x.shape[axis], *x.shape[axis + 1 :])
