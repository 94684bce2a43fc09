"""The MX GEMM: ``out[..., m, n] = sum_k a[..., m, k] * b[..., n, k]`` on MX operands.

It checks its operands and runs the kernels the dispatcher (:mod:`jaxmx._src.gemm.dispatch`)
chooses per lowering platform: an emulation, or the native custom call. The block-FP8 and FP4
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
from jax import lax

from jaxmx._src.core.block_sharding import ReducedAxis, check_block_alignment
from jaxmx._src.core.dtypes import check_float_dtype
from jaxmx._src.core.explicit_axes import on_explicit_axes
from jaxmx._src.core.mxarray import MXArray, check_gemm_pair, checked, untiled
from jaxmx._src.core.recipes import Accumulation, check_accumulation
from jaxmx._src.gemm import native
from jaxmx._src.gemm.accumulation import limited_matmul
from jaxmx._src.gemm.dequantized_matmul import dequantized_matmul
from jaxmx._src.gemm.dispatch import Gemm, kernels
from jaxmx._src.gemm.emulate import emulated_matmul
from jaxmx._src.gemm.scaled_dot import scaled_dot_matmul
from jaxmx._src.quantize.pow2_blocks import as_mx


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
    return on_explicit_axes(lambda a, b: run(chosen, a, b, out_dtype, accumulation), a, b)


def run(chosen: dict[str, str], a, b, out_dtype, accumulation: Accumulation | None = None):
    """The kernels of :func:`~jaxmx._src.gemm.dispatch.kernels` on checked operands (MXArrays,
    or GridArrays for ``"emulate_values"``), each on its lowering platform."""
    branches = {
        platform: (lambda a, b, run=KERNELS[name]: run(a, b, out_dtype, accumulation))
        for platform, name in chosen.items()
    }
    if len(branches) == 1:
        return branches["default"](a, b)
    return lax.platform_dependent(a, b, **branches)


def _native(a: MXArray, b: MXArray, out_dtype, fast_accum: bool = False) -> jax.Array:
    """The native GEMM of the operands' family (the first family among them, in this order, so
    that a mixed pair gets that GEMM's error naming the operand at fault). ``fast_accum``:
    cuBLASLt's FP8 fast accumulation for the per-tensor / per-row FP8 family, the one whose
    GEMM takes it (the block-scaled GEMMs have no such option, and are not asked)."""
    families = {a.format.gemm, b.format.gemm}
    family = next((f for f in ("fp8", "block_fp8", "fp4") if f in families), "mx")
    if family == "fp8":
        return native.current_fp8_matmul(a, b, out_dtype, fast_accum=fast_accum)
    if family == "block_fp8":
        return native.block_fp8_matmul(native.tn_form(a), native.tn_form(b), out_dtype)
    if family == "fp4":
        return native.fp4_matmul(native.tn_form(untiled(a)), native.tn_form(untiled(b)), out_dtype)
    return native.mx_matmul(untiled(a), untiled(b), out_dtype)


KERNELS = {
    "emulate": lambda a, b, out_dtype, _: emulated_matmul(untiled(a), untiled(b), out_dtype),
    "emulate_values": lambda a, b, out_dtype, _: emulated_matmul(a, b, out_dtype),
    "emulate_pow2_twin": lambda a, b, out_dtype, _: emulated_matmul(as_mx(a), as_mx(b), out_dtype),
    "dequantized": lambda a, b, out_dtype, _: dequantized_matmul(a, b, out_dtype),
    "limited": lambda a, b, out_dtype, acc: limited_matmul(untiled(a), untiled(b), out_dtype, acc),
    "native": lambda a, b, out_dtype, _: _native(a, b, out_dtype),
    "native_pow2_twin": lambda a, b, out_dtype, _: _native(as_mx(a), as_mx(b), out_dtype),
    "xla": lambda a, b, out_dtype, _: scaled_dot_matmul(untiled(a), untiled(b), out_dtype),
    "xla_pow2_twin": lambda a, b, out_dtype, _: scaled_dot_matmul(as_mx(a), as_mx(b), out_dtype),
}
"""Each kernel of :data:`~jaxmx._src.gemm.dispatch.KERNELS` as ``(a, b, out_dtype,
accumulation) -> out``: what :func:`jaxmx.matmul` runs, exact for every E8M0 scale span."""

TRAINING_KERNELS = {
    **KERNELS,
    "emulate": lambda a, b, out_dtype, _: emulated_matmul(
        untiled(a), untiled(b), out_dtype, exact=False
    ),
    "emulate_values": lambda a, b, out_dtype, _: emulated_matmul(a, b, out_dtype, exact=False),
}
""":data:`KERNELS` for the training GEMMs (``dot_general``, ``ragged_dot``, FSDP): the MX
emulation (``"emulate"``, ``"emulate_values"``) in its row-relative frame only, the others as
:data:`KERNELS` (docs/native.md: in every MX training step the exact path's check and branch
would double the compile time and raise the step's temporaries above bfloat16's)."""

FORWARD_KERNELS = {
    **TRAINING_KERNELS,
    "native": lambda a, b, out_dtype, _: _native(a, b, out_dtype, fast_accum=True),
}
""":data:`TRAINING_KERNELS` for a training GEMM's forward GEMM: the per-tensor / per-row FP8
family's native GEMM with cuBLASLt's fast accumulation, as TransformerEngine runs its forward
FP8 GEMMs (its dgrad and wgrad GEMMs keep the split accumulator, as :data:`TRAINING_KERNELS`
does)."""


def _check_operands(a: MXArray, b: MXArray) -> None:
    for name, q in (("a", a), ("b", b)):
        if q.ndim < 2 or q.axis < q.ndim - 2:
            raise ValueError(
                f"matmul operand {name} must be quantized along K, one of its last two axes "
                f"([..., rows, K] or [..., K, rows]), got shape {q.shape} quantized along axis "
                f"{q.axis}"
            )
    check_gemm_pair(a, b, "matmul")
