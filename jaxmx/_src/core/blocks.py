"""The block layout: how a tensor is cut into the groups that share a scale, and its views.

The one block view is :func:`blocked`: ``[outer, n_blocks, block, inner]`` around the block
axis, zero-padded; :func:`tiles` is its 2-D-tile twin.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core.blocks import blocked, padded_shape, scale_shape
    >>> blocked(jnp.ones((3, 40, 5)), 1, 32).shape
    (3, 2, 32, 5)
    >>> padded_shape((3, 40, 5), 1, 32), scale_shape((3, 40, 5), 1, 32)
    ((3, 64, 5), (3, 2, 5))
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxmx._src.core import bits
from jaxmx._src.core.formats import Format
from jaxmx._src.core.sizes import ceil_div, round_up


def blocking(shape: tuple[int, ...], axis: int, block: int, tile=None) -> tuple[int, ...]:
    """Elements per scale along each axis: ``block`` along ``axis``, or ``tile`` over the last
    two axes, 1 elsewhere."""
    if tile is not None:
        return (1,) * (len(shape) - 2) + tuple(tile)
    return tuple(block if i == axis else 1 for i in range(len(shape)))


def padded_shape(shape: tuple[int, ...], axis: int, block: int, tile=None) -> tuple[int, ...]:
    """``shape`` rounded up to whole blocks (or tiles): the shape of the codes."""
    return tuple(
        round_up(n, b) for n, b in zip(shape, blocking(shape, axis, block, tile), strict=True)
    )


def scale_shape(shape: tuple[int, ...], axis: int, block: int, tile=None) -> tuple[int, ...]:
    """The shape of the scales of a tensor of logical ``shape`` blocked along ``axis`` (or
    tiled)."""
    return tuple(
        ceil_div(n, b) for n, b in zip(shape, blocking(shape, axis, block, tile), strict=True)
    )


def blocked_shape(shape: tuple[int, ...], axis: int, block: int) -> tuple[int, int, int, int]:
    """A padded ``shape`` (whole blocks along ``axis``) viewed as ``[outer, n_blocks, block,
    inner]``; with ``block=1``, the matching view of its scales."""
    outer, inner = math.prod(shape[:axis]), math.prod(shape[axis + 1 :])
    return outer, shape[axis] // block, block, inner


def blocked(x: jax.Array, axis: int, block: int) -> jax.Array:
    """float32 view of x as [outer, n_blocks, block, inner], zero-padded along the block axis."""
    x = bits.upcast_exact(x)
    size = x.shape[axis]
    if size % block:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, round_up(size, block) - size)
        x = jnp.pad(x, pad)
    return x.reshape(blocked_shape(x.shape, axis, block))


def tiles(x: jax.Array, tile: tuple[int, int]) -> jax.Array:
    """``x [..., R, C]`` zero-padded to whole tiles and viewed as ``[outer, n_tiles, rows * cols,
    1]`` (tiles in row-major order, each tile's elements row-major)."""
    rows, cols = tile
    x = padded_to_tiles(x, tile)
    r, c = x.shape[-2:]
    outer = math.prod(x.shape[:-2])  # not -1: an empty x leaves it ambiguous
    x = x.reshape(outer, r // rows, rows, c // cols, cols).transpose(0, 1, 3, 2, 4)
    return x.reshape(outer, (r // rows) * (c // cols), rows * cols, 1)


def padded_to_tiles(x: jax.Array, tile: tuple[int, int]) -> jax.Array:
    """``x [..., R, C]`` zero-padded to whole tiles."""
    rows, cols = tile
    r, c = x.shape[-2:]
    pad = [(0, 0)] * (x.ndim - 2) + [(0, round_up(r, rows) - r), (0, round_up(c, cols) - c)]
    return jnp.pad(x, pad) if any(p for _, p in pad) else x


def tile_view(x: jax.Array, tile: tuple[int, int]) -> jax.Array:
    """``x [..., R, C]`` zero-padded to whole tiles and viewed as ``[outer, R / rows, rows,
    C / cols, cols]``: a reshape, no transpose; a tile's scale broadcasts over axes 2 and 4."""
    rows, cols = tile
    x = padded_to_tiles(x, tile)
    r, c = x.shape[-2:]
    return x.reshape(math.prod(x.shape[:-2]), r // rows, rows, c // cols, cols)


def untile(t: jax.Array, shape: tuple[int, ...], tile: tuple[int, int]) -> jax.Array:
    """The inverse of :func:`tiles` for a padded ``shape`` (whole tiles)."""
    rows, cols = tile
    r, c = shape[-2:]
    t = t.reshape(math.prod(shape[:-2]), r // rows, c // cols, rows, cols).transpose(0, 1, 3, 2, 4)
    return t.reshape(shape)


def block_of(f: Format, shape: tuple[int, ...], axis: int) -> int:
    """Elements per scale of ``f`` along ``axis`` of ``shape``: ``f.block``, or the whole axis
    (at least 1) for a format whose scale spans a row or the tensor (:attr:`Format.span`): the
    block of :func:`blocked`'s view.

    Example:
        >>> from jaxmx._src.core.formats import get_format
        >>> block_of(get_format("mxfp8_e4m3"), (4, 40), 1), block_of(get_format("fp8_e4m3_row"), (4, 40), 1)
        (32, 40)
    """  # noqa: E501
    return f.block if f.span == "block" else max(shape[axis], 1)


def format_scale_shape(f: Format, shape: tuple[int, ...], axis: int, tile=None) -> tuple[int, ...]:
    """The shape of ``f``'s scales for a tensor of logical ``shape`` quantized along ``axis``
    (or tiled): :func:`scale_shape` of its blocks, ``shape`` with ``axis`` set to 1 for one
    scale per row, all ones for one scale per tensor.

    Example:
        >>> from jaxmx._src.core.formats import get_format
        >>> [format_scale_shape(get_format(n), (4, 40), 0) for n in ("fp8_e4m3_row", "fp8_e4m3_tensor")]
        [(1, 40), (1, 1)]
    """  # noqa: E501
    if f.span == "tensor":
        return (1,) * len(shape)
    return scale_shape(shape, axis, block_of(f, shape, axis), tile)
