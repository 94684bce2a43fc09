"""The MX GEMM: ``out[..., m, n] = sum_k a[..., m, k] * b[..., n, k]`` on MX operands.

It checks its operands and hands them to a backend (:mod:`jaxmx._src.gemm.backends`): the emulation,
or the native custom call. The block-FP8 and FP4 GEMMs take TN operands (a K-first operand's
1-byte codes and scales are transposed for them); the MX GEMM takes K-first operands
untransposed where the default CUDA device has compute capability 10.x
(:func:`jaxmx.ffi.mx_matmul`). With ``backend="auto"`` the choice is made per lowering platform.

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
from jaxmx._src.core.mxarray import MXArray, check_gemm_pair, checked, untiled
from jaxmx._src.gemm import native
from jaxmx._src.gemm.accumulation import Accumulation, limited_matmul
from jaxmx._src.gemm.backends import BLOCK_FP8_FORMATS, FP4_FORMATS, per_platform
from jaxmx._src.gemm.dequantized_matmul import dequantized_matmul
from jaxmx._src.gemm.emulate import emulated_matmul


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
            operands' format family natively, MX or block FP8, else the emulation),
            ``"emulate"`` (any device) or ``"ffi"`` (the native custom call:
            :func:`jaxmx.ffi.mx_matmul`, :func:`jaxmx.ffi.block_fp8_matmul` or
            :func:`jaxmx.ffi.fp4_matmul`).
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
    if accum_bits is not None or promote_every is not None:
        return _limited(a, b, out_dtype, backend, accum_bits, promote_every)
    if backend == "auto" and not (_native_tiles(a) and _native_tiles(b)):
        backend = "emulate"
    runners = {
        platform: _RUNNERS[name] for platform, name in per_platform(backend, (a.fmt, b.fmt)).items()
    }
    if len(runners) == 1:
        return runners["default"](a, b, out_dtype)
    branches = {p: (lambda a, b, run=run: run(a, b, out_dtype)) for p, run in runners.items()}
    return lax.platform_dependent(a, b, **branches)


def _limited(a, b, out_dtype, backend, accum_bits, promote_every) -> jax.Array:
    if accum_bits is None:
        raise ValueError("matmul: promote_every needs accum_bits (a limited accumulator)")
    if not (a.format.is_mx and b.format.is_mx):
        raise ValueError(f"matmul: accum_bits models MX GEMMs only, got {a.fmt} x {b.fmt} operands")
    a, b = untiled(a), untiled(b)
    if backend not in ("auto", "emulate"):
        raise ValueError(
            f"matmul: accum_bits models the accumulator in the emulation only; backend {backend!r} "
            "cannot take it (use 'auto' or 'emulate')"
        )
    return limited_matmul(a, b, out_dtype, Accumulation(accum_bits, promote_every).check())


def _emulate(a: MXArray, b: MXArray, out_dtype) -> jax.Array:
    """The exact emulation (MX formats, NVFP4), or the float32 one for float32-scaled (block
    FP8), narrow-tiled and differently blocked (NVFP4 with MX) operands."""
    same_blocks = a.format.block == b.format.block
    if same_blocks and all(q.fmt not in BLOCK_FP8_FORMATS and _untileable(q) for q in (a, b)):
        return emulated_matmul(untiled(a), untiled(b), out_dtype)
    return dequantized_matmul(a, b, out_dtype)


def _untileable(q: MXArray) -> bool:
    return q.tile is None or q.tile[1] == q.format.block


def _native(a: MXArray, b: MXArray, out_dtype) -> jax.Array:
    if a.fmt in BLOCK_FP8_FORMATS or b.fmt in BLOCK_FP8_FORMATS:
        return native.block_fp8_matmul(native.tn_form(a), native.tn_form(b), out_dtype)
    if a.fmt in FP4_FORMATS or b.fmt in FP4_FORMATS:
        return native.fp4_matmul(native.tn_form(untiled(a)), native.tn_form(untiled(b)), out_dtype)
    return native.mx_matmul(untiled(a), untiled(b), out_dtype)


def _native_tiles(q: MXArray) -> bool:
    """Whether the native GEMM takes ``q``'s tiles: 128x128 for block FP8, block-wide for MX."""
    if q.tile is None:
        return True
    if q.fmt in BLOCK_FP8_FORMATS:
        return q.tile == (native.BLOCK_TILE, native.BLOCK_TILE)
    return _untileable(q)


_RUNNERS = {"emulate": _emulate, "ffi": _native}


def _check_operands(a: MXArray, b: MXArray) -> None:
    for name, q in (("a", a), ("b", b)):
        if q.ndim < 2 or q.axis < q.ndim - 2:
            raise ValueError(
                f"matmul operand {name} must be quantized along K, one of its last two axes "
                f"([..., rows, K] or [..., K, rows]), got shape {q.shape} quantized along axis "
                f"{q.axis}"
            )
    check_gemm_pair(a, b, "matmul")
