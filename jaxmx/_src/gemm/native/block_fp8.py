"""The native block-FP8 GEMM (custom call ``jaxmx_block_fp8_matmul``): DeepSeek's block FP8.

``fp8_e4m3_block`` / ``fp8_e5m2_block`` operands: one float32 scale per 1x128 block along K, or
per 128x128 tile for one of the operands; cuBLASLt ``VEC128_32F`` / ``BLK128x128_32F`` scaling,
compute capability 9.x and CUDA >= 12.9.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> a = jaxmx.quantize(jnp.ones((2, 128)), "fp8_e4m3_block")
    >>> block_fp8_matmul(a, a, jnp.float32).tolist()
    [[128.0, 128.0], [128.0, 128.0]]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmx._src.core.formats import formats_of
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.mxarray_layouts import untiled
from jaxmx._src.gemm.batching import vmappable
from jaxmx._src.gemm.kernels import Kernel
from jaxmx._src.gemm.native.call import N_MULTIPLE, custom_call
from jaxmx._src.gemm.native.operands import checked_pair, tn_form, zero_padding
from jaxmx._src.gemm.partitioning import partitioned_gemm

BLOCK_FP8_TARGET = "jaxmx_block_fp8_matmul"

BLOCK_FP8_FORMATS = formats_of(gemm="block_fp8")
"""The formats the native block-FP8 GEMM takes (1x128 blocks or 128x128 tiles, float32 scales),
in any pair but E5M2 x E5M2."""

BLOCK_TILE = 128
"""Block FP8: scales per 1x128 block along K, or per 128x128 tile (the one tile the GEMM
takes: DeepSeek-V3's weight tiles)."""


def block_fp8_matmul(a: MXArray, b: MXArray, out_dtype=jnp.bfloat16) -> jax.Array:
    """``a @ b^T`` for block-FP8 operands in TN form, on the native custom call.

    Args:
        a: [..., M, K] quantized along its last axis (``fp8_e4m3_block`` or ``fp8_e5m2_block``),
            in 1x128 blocks or 128x128 tiles (``tile=(128, 128)``).
        b: [..., N, K] likewise, same leading (batch) dims and K. E5M2 x E5M2 is not offered
            (cuBLASLt has no such FP8 kernel).
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        [..., M, N] in ``out_dtype``, accumulated in float32. cuBLASLt (compute capability 9.x,
        CUDA >= 12.9) takes 1x128 x 1x128, 1x128 x 128x128 and 128x128 x 1x128 scales: a tiled
        operand goes as 128x128 tiles when its rows are whole tiles (if both do, only ``b``),
        otherwise as 1x128 blocks with each tile's scale repeated over its rows (the same
        numbers). Works under ``jit``, ``vmap`` and SPMD partitioning.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> from jaxmx import ffi
        >>> a = jaxmx.quantize(jnp.ones((2, 256)), "fp8_e4m3_block")
        >>> b = jaxmx.quantize(jnp.full((3, 256), 0.5), "fp8_e4m3_block", tile=(128, 128))
        >>> ffi.block_fp8_matmul(a, b, jnp.float32).tolist()
        [[128.0, 128.0, 128.0], [128.0, 128.0, 128.0]]
    """
    fn = "block_fp8_matmul"
    a, b, out_dtype = checked_pair(a, b, out_dtype, fn, BLOCK_FP8_FORMATS, k_first_ok=False)
    for name, q in (("a", a), ("b", b)):
        if q.tile not in (None, (BLOCK_TILE, BLOCK_TILE)):
            raise ValueError(
                f"{fn}: {name} has {q.tile} tiles; the native GEMM takes 1x128 blocks or "
                f"({BLOCK_TILE}, {BLOCK_TILE}) tiles (use the emulation backend for other tiles)"
            )
    a_tiles, b_tiles = _whole_tiles(a), _whole_tiles(b) and not _whole_tiles(a)
    a, b = untiled(a), untiled(b)
    call = _block_call(out_dtype, a_tiles, b_tiles)
    return call(zero_padding(a), zero_padding(b), a.scale, b.scale)


def _whole_tiles(q: MXArray) -> bool:
    """Whether ``q`` can go to cuBLASLt as 128x128 tiles: tiled, its rows whole tiles (so that
    under vmap, which folds a batch into the rows, and per shard the tiles stay aligned)."""
    return q.tile is not None and q.shape[-2] % BLOCK_TILE == 0


@functools.cache
def _block_call(out_dtype, a_tiles: bool, b_tiles: bool):
    # Operands travel as 1x128 blocks (tile scales repeated over their rows), so vmap and SPMD
    # treat them like MX operands; each shard takes back one scale row per tile where it can.
    per_shard = functools.partial(_block_per_shard, tiles=(a_tiles, b_tiles))
    gemm = partitioned_gemm(per_shard, out_dtype, "jaxmx.ffi.block_fp8_matmul", BLOCK_TILE)
    return jax.jit(vmappable(gemm, fold=(True, False, True, False)))


@functools.cache
def _block_per_shard(out_dtype, tiles: tuple[bool, bool] = (False, False)):
    """The custom call on (one device's) operands [..., rows, K] and their per-row scales
    [..., rows, K/128]: scales laid out as cuBLASLt wants them, then the call."""

    def impl(a_data, b_data, a_scale, b_scale):
        # a shard whose rows do not start and end on tile boundaries keeps 1x128 blocks
        a_tiled = tiles[0] and a_data.shape[-2] % BLOCK_TILE == 0
        b_tiled = tiles[1] and b_data.shape[-2] % BLOCK_TILE == 0

        def prepare(a_data, b_data, a_scale, b_scale):
            n = b_data.shape[-2]
            a_data, a_scale = _block_operand(a_data, a_scale, a_tiled, N_MULTIPLE)
            b_data, b_scale = _block_operand(b_data, b_scale, b_tiled, N_MULTIPLE)
            return (a_data, b_data, a_scale, b_scale), n

        return custom_call(
            BLOCK_FP8_TARGET,
            "block_fp8_matmul",
            out_dtype,
            prepare,
            a_data,
            b_data,
            a_scale,
            b_scale,
            attributes={"lhs_tiled": a_tiled, "rhs_tiled": b_tiled},
        )

    return impl


def _block_operand(data, scale, tiled: bool, row_multiple: int):
    """Codes and float32 scales in cuBLASLt's block-FP8 layouts (ffi/layout.h).

    1x128 blocks: rows padded with zeros to ``row_multiple``, scales ``[..., K/128, rows]``
    (rows contiguous). 128x128 tiles: scales ``[..., rows/128, roundup(K/128, 4)]``, one row per
    tile (the per-row scales are constant over each tile), zero-padded.
    """
    if tiled:
        pad = [(0, 0)] * (scale.ndim - 1) + [(0, -scale.shape[-1] % 4)]
        return data, jnp.pad(scale[..., ::BLOCK_TILE, :], pad)
    pad = [(0, 0)] * (data.ndim - 2) + [(0, -data.shape[-2] % row_multiple), (0, 0)]
    return jnp.pad(data, pad), jnp.pad(scale, pad).swapaxes(-1, -2)


BLOCK_FP8_KERNEL = Kernel(
    name="native",
    run=lambda a, b, out_dtype, _: block_fp8_matmul(tn_form(a), tn_form(b), out_dtype),
    needs="block_fp8",
    platform="cuda",
)
"""The native block-FP8 GEMM as a kernel (K-first operands transposed to TN form)."""
