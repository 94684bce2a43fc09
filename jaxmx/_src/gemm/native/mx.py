"""The native MX GEMM (custom call ``jaxmx_mx_matmul``): MXFP8 operands, E8M0 scales per 32.

cuBLASLt ``VEC32_UE8M0`` block scaling, which needs compute capability >= 10.0 and CUDA >= 12.8;
the scales go in the cuBLAS 128x4 tiled layout. TN operands everywhere; K-first operands
untransposed where the default CUDA device has compute capability 10.x.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> a = jaxmx.quantize(jnp.ones((4, 64)))
    >>> mx_matmul(a, a, jnp.float32)[0, :2].tolist()
    [64.0, 64.0]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmx._src.core import wire
from jaxmx._src.core.formats import formats_of, get_format
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.mxarray_layouts import untiled
from jaxmx._src.core.swizzle import swizzle_scales
from jaxmx._src.gemm import capabilities
from jaxmx._src.gemm.batching import vmappable
from jaxmx._src.gemm.kernels import Kernel
from jaxmx._src.gemm.native.call import N_MULTIPLE, custom_call, pad_rows
from jaxmx._src.gemm.native.operands import checked_pair, is_k_first, tn_form, zero_padding
from jaxmx._src.gemm.partitioning import partitioned_gemm
from jaxmx._src.quantize.pow2_blocks import as_mx

MX_TARGET = "jaxmx_mx_matmul"

MXFP8_FORMATS = formats_of(gemm="mx")
"""The formats the native MX GEMM takes (MXFP8), in any pair but E5M2 x E5M2 (cuBLASLt's FP8
type table has E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3)."""


def mx_matmul(a: MXArray, b: MXArray, out_dtype=jnp.bfloat16) -> jax.Array:
    """``a @ b^T`` for MXFP8 operands, on the native custom call.

    Args:
        a: [..., M, K] quantized along its last axis (``mxfp8_e4m3`` or ``mxfp8_e5m2``: the TN
            form), or [..., K, M] quantized along K, its axis -2 (a columnwise copy kept
            untransposed, as the training GEMM's gradients use).
        b: [..., N, K] or [..., K, N] likewise, same leading (batch) dims and K.
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        [..., M, N] in ``out_dtype``, accumulated in float32. The compact scales are swizzled to
        the cuBLAS 128x4 layout right before the call. Where the default CUDA device has compute
        capability 10.x (:attr:`~jaxmx._src.gemm.capabilities.Capabilities.non_tn_mx`) a K-first
        operand's codes go to cuBLASLt untransposed (only its small scale tensor is re-laid);
        everywhere else (12.x, no GPU) its codes and scales are transposed to TN form first. The
        CPU handler takes both layouts and gives the same bits. Works under ``jit``, ``vmap``
        and SPMD partitioning.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> from jaxmx import ffi
        >>> a = jaxmx.quantize(jnp.ones((2, 3, 32)))
        >>> b = jaxmx.quantize(jnp.ones((2, 5, 32)), "mxfp8_e5m2")
        >>> ffi.mx_matmul(a, b).shape
        (2, 3, 5)
        >>> a_k_first = jaxmx.quantize(jnp.ones((2, 32, 3)), axis=1)  # [..., K, M]
        >>> ffi.mx_matmul(a_k_first, b, jnp.float32)[0, 0].tolist()
        [32.0, 32.0, 32.0, 32.0, 32.0]
    """
    a, b, out_dtype = checked_pair(a, b, out_dtype, "mx_matmul", MXFP8_FORMATS, k_first_ok=True)
    if not capabilities.current().non_tn_mx:
        a, b = tn_form(a), tn_form(b)  # the all-TN path (sm_12x, CPU-only hosts)
    k_first = (is_k_first(a), is_k_first(b))
    return _mx_call(out_dtype, k_first)(zero_padding(a), zero_padding(b), a.scale, b.scale)


@functools.cache
def _mx_call(out_dtype, k_first: tuple[bool, bool]):
    # vmap outside, SPMD partitioning inside: each device swizzles the scales of its own blocks.
    # Jitted, so that eager calls hit a compiled-call cache instead of re-tracing. A K-first lhs
    # cannot fold a vmapped batch into its rows (its last axis): the batch stays a batch.
    block = get_format(MXFP8_FORMATS[0]).block
    per_shard = functools.partial(_mx_per_shard, k_first=k_first)
    gemm = partitioned_gemm(per_shard, out_dtype, "jaxmx.ffi.mx_matmul", block, k_first)
    return jax.jit(vmappable(gemm, fold=None if k_first[0] else (True, False, True, False)))


@functools.cache
def _mx_per_shard(out_dtype, k_first: tuple[bool, bool] = (False, False)):
    """The custom call on (one device's) operands: swizzles the compact scales, then calls."""

    def prepare(a_data, b_data, a_scale, b_scale):
        if k_first[1]:
            n = b_data.shape[-1]
            b_data, b_scale = _k_first_operand(b_data, b_scale, N_MULTIPLE)
        else:
            b_data, b_scale, n = pad_rows(b_data, b_scale, N_MULTIPLE)
        if k_first[0]:
            a_data, a_scale = _k_first_operand(a_data, a_scale, N_MULTIPLE)
        return (a_data, b_data, swizzle_scales(a_scale), swizzle_scales(b_scale)), n

    def impl(a_data, b_data, a_scale, b_scale):
        return custom_call(
            MX_TARGET,
            "mx_matmul",
            out_dtype,
            prepare,
            a_data,
            b_data,
            a_scale,
            b_scale,
            attributes={"lhs_k_first": k_first[0], "rhs_k_first": k_first[1]},
            k_first=k_first,
        )

    return impl


def _k_first_operand(data, scale, row_multiple: int):
    """A K-first MX operand for the custom call: the codes [..., K, rows] stay untransposed,
    their rows (the leading dimension cuBLASLt sees) padded with zero codes to ``row_multiple``;
    the compact scales [..., K/32, rows] become [..., rows, K/32], padded alike.

    That is the one re-laying a K-first operand needs: cuBLASLt indexes VEC32_UE8M0 scales by
    (row of the operand, K-block) whatever the data layout (ffi/cublaslt_gemm.h).
    """
    pad = [(0, 0)] * (data.ndim - 1) + [(0, -data.shape[-1] % row_multiple)]
    return jnp.pad(data, pad), jnp.pad(wire.as_bytes(scale), pad).swapaxes(-1, -2)


MX_KERNEL = Kernel(
    name="native",
    run=lambda a, b, out_dtype, _: mx_matmul(untiled(a), untiled(b), out_dtype),
    needs="mx",
    platform="cuda",
)
"""The native MX GEMM as a kernel."""

MX_POW2_TWIN_KERNEL = Kernel(
    name="native_pow2_twin",
    run=lambda a, b, out_dtype, _: mx_matmul(untiled(as_mx(a)), untiled(as_mx(b)), out_dtype),
    needs="mx",
    platform="cuda",
)
"""Block FP8 with power-of-two scales, re-encoded as its MX twin, on the native MX GEMM (a device
with the MX GEMM but not the block-FP8 one: Blackwell)."""
