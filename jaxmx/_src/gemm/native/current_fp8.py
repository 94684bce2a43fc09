"""Per-tensor and per-row FP8 MXArrays (torchao's current scaling) on the per-tensor FP8 GEMM.

Two per-tensor operands go to :func:`~jaxmx._src.gemm.native.fp8.fp8_matmul` with their decode
factors; a per-row operand runs it with unit scales, then :func:`row_scaled` divides the rows'
and columns' scales out.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.ones((2, 24)), "fp8_e4m3_row")
    >>> tn_codes(q).shape  # K padded to a multiple of 16
    (2, 32)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmx._src.core import bits, exponents, ieee_arithmetic, wire
from jaxmx._src.core.formats import formats_of
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.gemm.kernels import Kernel
from jaxmx._src.gemm.native.fp8 import fp8_matmul
from jaxmx._src.gemm.native.operands import checked_pair, tn_form

CURRENT_FP8_FORMATS = formats_of(gemm="fp8")
"""The per-tensor and per-row FP8 formats (torchao's current scaling), which run on the per-tensor
FP8 GEMM (:func:`fp8_matmul`) in any pair but E5M2 x E5M2."""

FP8_K_MULTIPLE = 16
"""cuBLASLt's FP8 GEMM wants K a multiple of 16: :func:`current_fp8_matmul` pads K with zero
codes to one (they contribute nothing)."""


def current_fp8_matmul(a: MXArray, b: MXArray, out_dtype=jnp.bfloat16, *, fast_accum=False):
    """``a @ b^T`` for per-tensor or per-row FP8 operands on the native per-tensor FP8 GEMM.

    Args:
        a: [..., M, K] or [..., K, M] quantized along K (``fp8_e4m3_tensor``,
            ``fp8_e5m2_tensor``, ``fp8_e4m3_row``, ``fp8_e5m2_row``).
        b: [..., N, K] or [..., K, N] likewise, same leading (batch) dims and K. E5M2 x E5M2 is
            not offered (cuBLASLt has no such FP8 kernel).
        out_dtype: bfloat16 (default), float16 or float32.
        fast_accum: cuBLASLt's FP8 fast accumulation (:func:`fp8_matmul`).

    Returns:
        [..., M, N] in ``out_dtype``. A K-first operand's codes are transposed to TN form first
        and K is padded with zero codes to a multiple of 16. Two per-tensor operands: the float32
        sum of the products of codes ``acc`` times their decode factors ``1/s_a`` and ``1/s_b``
        (float32 quotients), as cuBLASLt applies them (``SCALAR_32F``), rounded once to
        ``out_dtype``. Otherwise (a per-row operand): the same GEMM with unit scales in float32,
        then ``acc[m, n] / (s_a[m] * s_b[n])``, the scales' mantissas multiplied and divided out
        (two float32 roundings) and their exponents applied exactly (no intermediate overflow or
        underflow; exact for ``pow2`` scales), then ``out_dtype``. Equal to the emulation up to
        float32 rounding (docs/native.md states the bound). Works under ``jit`` and ``vmap``.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> from jaxmx._src.gemm.native import current_fp8_matmul
        >>> a = jaxmx.quantize(jnp.ones((2, 24)), "fp8_e4m3_tensor")  # K = 24: padded to 32
        >>> b = jaxmx.quantize(jnp.full((3, 24), 0.5), "fp8_e4m3_row")
        >>> current_fp8_matmul(a, b, jnp.float32).tolist()
        [[12.0, 12.0, 12.0], [12.0, 12.0, 12.0]]
    """
    fn = "current_fp8_matmul"
    a, b, out_dtype = checked_pair(a, b, out_dtype, fn, CURRENT_FP8_FORMATS, k_first_ok=True)
    a, b = tn_form(a), tn_form(b)
    a_codes, b_codes = tn_codes(a), tn_codes(b)
    if a.format.span == b.format.span == "tensor":
        factors = (_decode_factor(q) for q in (a, b))
        return fp8_matmul(a_codes, b_codes, *factors, out_dtype, fast_accum=fast_accum)
    acc = fp8_matmul(a_codes, b_codes, 1.0, 1.0, jnp.float32, fast_accum=fast_accum)
    return row_scaled(acc, a.scale[..., 0], b.scale[..., 0]).astype(out_dtype)


def tn_codes(q: MXArray) -> jax.Array:
    """The codes of a per-tensor or per-row ``q`` as :func:`current_fp8_matmul` hands them to
    the GEMM: [..., rows, Kp] (TN form), K padded with zero codes to ``Kp``, a multiple of
    :data:`FP8_K_MULTIPLE`."""
    codes = tn_form(q).data
    pad = -codes.shape[-1] % FP8_K_MULTIPLE
    if not pad:
        return codes
    padded = jnp.pad(wire.as_bytes(codes), [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
    return wire.from_bytes(padded, codes.dtype)


def _decode_factor(q: MXArray) -> jax.Array:
    """``1 / scale`` of a per-tensor ``q`` (float32, rounded once), shaped like its batch dims:
    the factor :func:`fp8_matmul` multiplies its codes by."""
    scale = q.scale.reshape(q.scale.shape[:-2])
    return jnp.broadcast_to(ieee_arithmetic.divide(1.0, scale), q.data.shape[:-2])


def row_scaled(acc: jax.Array, a_scale: jax.Array, b_scale: jax.Array) -> jax.Array:
    """``acc[..., m, n] / (a_scale[..., m] * b_scale[..., n])`` in float32 for normal float32
    scales (NaN passes through): each scale split into its mantissa ``f`` in [1, 2) and its
    exponent ``e``, ``acc / (f_a * f_b)`` (two roundings), then ``2^-(e_a + e_b)`` applied with
    one rounding (:func:`~jaxmx._src.core.exponents.ldexp_rounded`), so no intermediate product
    overflows or underflows. Exact up to that rounding of ``acc`` for power-of-two scales.

    Example:
        >>> import jax.numpy as jnp
        >>> row_scaled(jnp.full((1, 2), 6.0), jnp.float32([2.0**100]), jnp.float32([3.0, 2.0**-90]))
        Array([[1.5777218e-30, 5.8593750e-03]], dtype=float32)
    """
    fa, ea = _mantissa_exponent(a_scale[..., :, None])
    fb, eb = _mantissa_exponent(b_scale[..., None, :])
    return exponents.ldexp_rounded(ieee_arithmetic.divide(acc, fa * fb), -(ea + eb))


def _mantissa_exponent(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(f, e)`` with ``s = f * 2^e``, ``f`` in [1, 2), of normal float32 ``s`` (NaN: f NaN)."""
    u = bits.to_bits(s)
    f = bits.from_bits((u & bits.MANTISSA_MASK) | 0x3F800000)
    e = ((u >> bits.MANTISSA_BITS) & 0xFF) - 127
    return jnp.where(jnp.isnan(s), jnp.nan, f), e


FP8_KERNEL = Kernel(
    name="native",
    run=lambda a, b, out_dtype, _: current_fp8_matmul(a, b, out_dtype),
    forward=lambda a, b, out_dtype, _: current_fp8_matmul(a, b, out_dtype, fast_accum=True),
    needs="fp8",
    platform="cuda",
)
"""The per-tensor / per-row FP8 formats' native GEMM as a kernel; a training GEMM's forward GEMM
runs with cuBLASLt's fast accumulation, as TransformerEngine runs its forward FP8 GEMMs (its
dgrad and wgrad GEMMs keep the split accumulator)."""
