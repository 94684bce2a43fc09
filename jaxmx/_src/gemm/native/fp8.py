"""The native per-tensor FP8 GEMM (custom call ``jaxmx_fp8_matmul``) on raw FP8 arrays.

FP8 operands with one float32 scale per tensor (or per batch element): cuBLASLt ``SCALAR_32F``
scaling, compute capability >= 8.9, so Hopper too.

Example:
    >>> import jax.numpy as jnp
    >>> a = jnp.full((1, 16), 2.0, jnp.float8_e4m3fn)
    >>> fp8_matmul(a, a, 1.0, 0.25, jnp.float32).tolist()
    [[16.0]]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmx._src.core.dtypes import check_float_dtype
from jaxmx._src.gemm import extension
from jaxmx._src.gemm.batching import vmappable
from jaxmx._src.gemm.native.call import N_MULTIPLE, custom_call, pad_rows

FP8_TARGET = "jaxmx_fp8_matmul"

_FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def fp8_matmul(
    a_fp8, b_fp8, a_scale, b_scale, out_dtype=jnp.bfloat16, *, fast_accum: bool = False
) -> jax.Array:
    """``(a_scale * b_scale) * (a @ b^T)`` for FP8 operands with per-tensor float32 scales.

    The cuBLASLt FP8 GEMM (compute capability >= 8.9, Hopper included) through the same
    machinery as :func:`jaxmx.ffi.mx_matmul`; on CPU the C++ handler.

    Args:
        a_fp8: [..., M, K] float8_e4m3fn or float8_e5m2.
        b_fp8: [..., N, K], same leading dims and K; E5M2 x E5M2 is not offered (cuBLASLt has
            no such kernel). K must be a multiple of 16 (a cuBLASLt FP8 requirement).
        a_scale, b_scale: float32 scalars (or one per batch element, shaped like the batch dims)
            that dequantize the operands: ``a = a_scale * a_fp8``.
        out_dtype: bfloat16 (default), float16 or float32.
        fast_accum: cuBLASLt's FP8 fast accumulation (``CUBLASLT_MATMUL_DESC_FAST_ACCUM``):
            faster on Hopper, with partial sums promoted to full float32 less often; meant for
            forward GEMMs (gradients keep the default). The CPU handler ignores it.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmx import ffi
        >>> a = jnp.ones((2, 16), jnp.float8_e4m3fn)
        >>> ffi.fp8_matmul(a, a, 0.5, 2.0, jnp.float32).tolist()
        [[16.0, 16.0], [16.0, 16.0]]
    """
    a_fp8, b_fp8 = jnp.asarray(a_fp8), jnp.asarray(b_fp8)
    for name, x in (("a_fp8", a_fp8), ("b_fp8", b_fp8)):
        if x.dtype not in _FP8_DTYPES:
            raise TypeError(
                f"fp8_matmul: {name} must be float8_e4m3fn or float8_e5m2, got {x.dtype}"
            )
        if x.ndim < 2:
            raise ValueError(f"fp8_matmul: {name} must be [..., rows, K], got shape {x.shape}")
    if a_fp8.dtype == b_fp8.dtype == jnp.float8_e5m2:
        raise TypeError(
            "fp8_matmul: float8_e5m2 x float8_e5m2 is not supported (cuBLASLt has no such FP8 "
            "kernel); make one operand float8_e4m3fn"
        )
    if a_fp8.shape[-1] != b_fp8.shape[-1]:
        raise ValueError(
            f"fp8_matmul: contracting sizes differ: a {a_fp8.shape} vs b {b_fp8.shape} "
            "(operands are [..., M, K] and [..., N, K])"
        )
    if a_fp8.shape[-1] % 16:
        raise ValueError(f"fp8_matmul: K must be a multiple of 16, got {a_fp8.shape[-1]}")
    batch = a_fp8.shape[:-2]
    if b_fp8.shape[:-2] != batch:
        raise ValueError(f"fp8_matmul: batch dimensions differ: a {batch} vs b {b_fp8.shape[:-2]}")
    scales = []
    for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        s = jnp.asarray(s)
        if not jnp.issubdtype(s.dtype, jnp.floating):
            raise TypeError(f"fp8_matmul: {name} must be a float scale, got {s.dtype}")
        if s.shape not in ((), batch):
            raise ValueError(
                f"fp8_matmul: {name} must be a scalar or have the batch shape {batch}, got "
                f"{s.shape}"
            )
        scales.append(jnp.broadcast_to(s.astype(jnp.float32), batch))
    out_dtype = check_float_dtype(out_dtype, "fp8_matmul: out_dtype")
    extension.register_targets()
    return _fp8_call(out_dtype, bool(fast_accum))(a_fp8, b_fp8, *scales)


@functools.cache
def _fp8_call(out_dtype, fast_accum: bool):
    def prepare(a_fp8, b_fp8, a_scale, b_scale):
        b_fp8, _, n = pad_rows(b_fp8, b_scale, N_MULTIPLE)
        return (a_fp8, b_fp8, a_scale, b_scale), n

    def impl(a_fp8, b_fp8, a_scale, b_scale):
        return custom_call(
            FP8_TARGET,
            "fp8_matmul",
            out_dtype,
            prepare,
            a_fp8,
            b_fp8,
            a_scale,
            b_scale,
            attributes={"fast_accum": fast_accum},
        )

    return jax.jit(vmappable(impl, fold=(True, False, False, False)))
