"""The MX GEMM: ``out[..., m, n] = sum_k a[..., m, k] * b[..., n, k]`` on MX operands.

It checks its operands and runs (:func:`~jaxmx._src.gemm.kernels.execute`) the kernels the
dispatcher (:mod:`jaxmx._src.gemm.dispatch`) chooses per lowering platform: an emulation, or the
native custom call. The block-FP8 and FP4
GEMMs take TN operands (a K-first operand's 1-byte codes and scales are transposed for them);
the MX GEMM takes K-first operands untransposed where the CUDA device has compute capability
10.x (:func:`jaxmx.ffi.mx_matmul`).

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> a = jaxmx.quantize(jnp.ones((2, 64)), "mxfp8_e4m3")
    >>> b = jaxmx.quantize(jnp.full((3, 64), 0.5), "mxfp8_e4m3")
    >>> jaxmx.matmul(a, b, jnp.float32).tolist()
    [[32.0, 32.0, 32.0], [32.0, 32.0, 32.0]]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmx._src.core.block_sharding import ReducedAxis, check_block_alignment
from jaxmx._src.core.dtypes import check_float_dtype
from jaxmx._src.core.explicit_axes import on_explicit_axes
from jaxmx._src.core.mxarray import MXArray, check_gemm_pair, checked
from jaxmx._src.core.recipes import check_accumulation
from jaxmx._src.gemm.dispatch import Gemm, kernels
from jaxmx._src.gemm.kernels import execute


def matmul(
    a: MXArray,
    b: MXArray,
    out_dtype=jnp.bfloat16,
    backend: str = "auto",
    *,
    accum_bits: int | None = None,
    promote_every: int | None = None,
) -> jax.Array:
    """Multiplies two MX operands, each quantized along the contracting axis K.

    Args:
        a: [..., M, K] quantized along K (its last axis: the TN form), or [..., K, M] quantized
            along K (its axis -2: a columnwise copy kept untransposed).
        b: [..., N, K] or [..., K, N] likewise, with the same leading (batch) shape as ``a``.
        out_dtype: bfloat16 (default), float16 or float32: the dtype of the result [..., M, N].
        backend: ``"auto"`` (default: per lowering platform, cuBLASLt on CUDA where it runs the
            operands' format family natively (MXFP8, FP4, block FP8, or per-tensor / per-row
            FP8 from compute capability 8.9), else the emulation),
            ``"emulate"`` (any device) or ``"ffi"`` (the native custom call:
            :func:`jaxmx.ffi.mx_matmul`, :func:`jaxmx.ffi.block_fp8_matmul`,
            :func:`jaxmx.ffi.fp4_matmul`, or :func:`jaxmx.ffi.fp8_matmul` for the per-tensor
            and per-row FP8 formats) or ``"xla"`` (``jax.lax.scaled_dot``: MX formats and
            NVFP4; block FP8 is refused here, its float32 scales not known to be powers of two).
        accum_bits, promote_every: a modelled limited-precision accumulator (the emulation only,
            as :attr:`jaxmx.Recipe.accum_bits`); ``None``: float32 accumulation.

    The emulation (:mod:`jaxmx._src.gemm.emulate`) agrees with the native GEMM wherever the exact
    result is a finite float32, except that XLA:CPU flushes subnormal operands, products and
    partial sums (docs/training_gemm.md).
    """
    a, b = checked(a, "matmul: a"), checked(b, "matmul: b")
    _check_operands(a, b)
    out_dtype = check_float_dtype(out_dtype, "matmul: out_dtype")
    for name, q in (("a", a), ("b", b)):
        axis = ReducedAxis(q.data_axis, "K", "the contracting dimension")
        check_block_alignment(q.data, "jaxmx.matmul", name, (axis,), q.format.block)
    formats = (a.format, b.format)
    accumulation = check_accumulation(accum_bits, promote_every, formats, backend, "jaxmx.matmul")
    chosen = kernels(
        Gemm(
            formats=(a.fmt, b.fmt),
            tiles=(a.tile, b.tile),
            backend=backend,
            accumulation=accumulation,
        )
    )
    return on_explicit_axes(
        lambda a, b: execute(chosen, a, b, out_dtype, accumulation=accumulation), a, b
    )


def _check_operands(a: MXArray, b: MXArray) -> None:
    for name, q in (("a", a), ("b", b)):
        if q.ndim < 2 or q.axis < q.ndim - 2:
            raise ValueError(
                f"matmul operand {name} must be quantized along K, one of its last two axes "
                f"([..., rows, K] or [..., K, rows]), got shape {q.shape} quantized along axis "
                f"{q.axis}"
            )
    check_gemm_pair(a, b, "matmul")
