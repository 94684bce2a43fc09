"""Another layout of an MXArray's codes and scales, without requantizing: a per-tensor array
along another axis (:func:`along`), the stored transpose (:func:`swap_last_axes`), and tiles as
1-D blocks (:func:`untiled`).

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.ones((32, 64)), "mxfp8_e4m3", axis=0)
    >>> t = swap_last_axes(q)
    >>> t.shape, t.axis, bool((jaxmx.dequantize(t) == jaxmx.dequantize(q).T).all())
    ((64, 32), 1, True)
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxmx._src.core.mxarray import MXArray


def along(q: MXArray, axis: int) -> MXArray:
    """A per-tensor ``q`` as the quantization of the same tensor along ``axis`` (non-negative):
    the same codes and scale, since one scale per tensor does not depend on the axis."""
    if q.format.span != "tensor":
        raise ValueError(f"along: only a per-tensor MXArray serves every axis, not an {q.fmt} one")
    return MXArray(q.data, q.scale, q.fmt, axis, q.shape, None, q.global_scale)


def swap_last_axes(q: MXArray) -> MXArray:
    """``q`` [..., A, B] blocked along A, stored transposed: [..., B, A] blocked along axis -1.

    Only the held codes and the scales move. E.g. a columnwise copy quantized along M of
    ``x [M, K]`` becomes the TN operand ``[K, M]`` of a GEMM that reduces M. A tiled ``q``
    becomes the tiled transpose (``tile`` reversed): the same codes serve ``x`` and ``x.T``
    (packed codes are packed again along the new last axis).
    """
    shape = (*q.shape[:-2], q.shape[-1], q.shape[-2])
    tile = None if q.tile is None else q.tile[::-1]
    scale = q.scale.swapaxes(-1, -2)
    if tile is not None and q.format.packing:  # packed along the last axis, which moves
        data = q.data.swapaxes(-1, -2)
        return MXArray(data, scale, q.fmt, len(shape) - 1, shape, tile, q.global_scale)
    held = q.held.swapaxes(-1, -2)  # blocks along -2 become blocks along -1, groups whole
    return MXArray.from_held(held, scale, q.fmt, len(shape) - 1, shape, tile, q.global_scale)


def untiled(q: MXArray) -> MXArray:
    """A tiled ``q`` as 1-D blocks along its last axis (each tile's scale repeated over its
    rows), for consumers that take only 1-D blocks; the codes are unchanged. Needs tiles as wide
    as the format's block."""
    if q.tile is None:
        return q
    rows, cols = q.tile
    if cols != q.format.block:
        raise ValueError(
            f"a {q.tile} tiled MXArray has no 1-D form: its tiles must be {q.format.block} wide"
        )
    n = q.shape[-2]
    held = q.held[..., :n, :]  # rows: not the axis that codes are packed along
    scale = jnp.repeat(q.scale, rows, axis=-2)[..., :n, :]
    return MXArray.from_held(held, scale, q.fmt, q.axis, q.shape, global_scale=q.global_scale)
