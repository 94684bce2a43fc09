"""The native FP4 GEMM (custom call ``jaxmx_fp4_matmul``): both operands MXFP4 or both NVFP4.

E2M1 codes packed two per byte; MXFP4's E8M0 scales per 32, or NVFP4's E4M3 scales per 16 and a
float32 tensor scale each (applied as ``alpha``); cuBLASLt ``VEC32_UE8M0`` / ``VEC16_UE4M3``
scaling on ``CUDA_R_4F_E2M1``, compute capability >= 10.0 and CUDA >= 12.8.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.ones((2, 32)), "mxfp4")
    >>> fp4_scales(q).shape, fp4_scales(q).dtype
    ((2, 1), dtype('uint8'))
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core import wire
from jaxmx._src.core.blocks import padded_shape
from jaxmx._src.core.formats import formats_of
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.mxarray_layouts import untiled
from jaxmx._src.core.swizzle import swizzle_scales
from jaxmx._src.gemm.batching import vmappable
from jaxmx._src.gemm.kernels import Kernel
from jaxmx._src.gemm.native.call import N_MULTIPLE, custom_call, pad_rows
from jaxmx._src.gemm.native.operands import checked_pair, tn_form

FP4_TARGET = "jaxmx_fp4_matmul"

FP4_FORMATS = formats_of(gemm="fp4")
"""The formats the native FP4 GEMM takes: both operands MXFP4 or both NVFP4 (E2M1 codes; E8M0
scales per 32 or E4M3 scales per 16 and a float32 tensor scale)."""


FP4_K_MULTIPLE = 32
"""FP4 operands go to the custom call with K padded (zero codes) to a multiple of 32: cuBLASLt
wants 16-byte aligned rows (leading dimensions) of packed E2M1 codes, i.e. 32 elements."""


def fp4_matmul(a: MXArray, b: MXArray, out_dtype=jnp.bfloat16) -> jax.Array:
    """``a @ b^T`` for FP4 operands in TN form (both MXFP4 or both NVFP4), natively.

    Args:
        a: [..., M, K] quantized along its last axis (``mxfp4`` or ``nvfp4``), in 1-D blocks or
            tiles as wide as the block.
        b: [..., N, K] likewise, same format, leading (batch) dims and K.
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        [..., M, N] in ``out_dtype``: ``float32(alpha * acc)`` rounded to ``out_dtype``, where
        ``acc`` sums the exact products ``(code_a * s_a) * (code_b * s_b)`` over K in float32
        (exact within each block, blocks added in order by the CPU handler) and ``alpha`` is
        ``float32(g_a * g_b)``, the product of the NVFP4 tensor scales (one per batch element
        under ``vmap``), or 1 for MXFP4. A NaN block scale gives NaN where its block reaches.
        The E2M1 codes are packed two per byte (element ``2i`` in the low nibble), K is padded
        with zero codes to a multiple of 32 and the scales are swizzled to the cuBLAS 128x4
        layout right before the call. Works under ``jit`` and ``vmap``.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> from jaxmx import ffi
        >>> a = jaxmx.quantize(jnp.full((2, 16), 10.5), "nvfp4")  # g = 2^-8: values exact
        >>> b = jaxmx.quantize(jnp.full((3, 16), -5.25), "nvfp4")  # g = 2^-9
        >>> ffi.fp4_matmul(a, b, jnp.float32).tolist()
        [[-882.0, -882.0, -882.0], [-882.0, -882.0, -882.0]]
    """
    a, b, out_dtype = checked_pair(a, b, out_dtype, "fp4_matmul", FP4_FORMATS, k_first_ok=False)
    nvfp4 = a.format.has_global_scale
    return _fp4_call(out_dtype, nvfp4)(*_fp4_operands(a, b))


@jax.jit
def _fp4_operands(a: MXArray, b: MXArray):
    """The FP4 custom call's operands of checked ``a`` and ``b``: packed codes, compact scale
    bytes and tensor scales. Jitted, so that an eager call runs one compiled program."""
    a, b = untiled(a), untiled(b)
    batch = a.held.shape[:-2]
    return (
        _packed_codes(a),
        _packed_codes(b),
        fp4_scales(a),
        fp4_scales(b),
        _tensor_scale(a, batch),
        _tensor_scale(b, batch),
    )


def _packed_codes(q: MXArray) -> jax.Array:
    """uint8 [..., rows, Kp / 2]: the E2M1 codes of ``q`` with the padding of K zeroed (whatever
    a hand-built one holds), K padded to ``Kp``, a multiple of :data:`FP4_K_MULTIPLE`, and two
    codes per byte: element ``2i`` in the low nibble, ``2i + 1`` in the high nibble.

    That is CUDA's ``__nv_fp4x2`` storage, which cuBLASLt reads for ``CUDA_R_4F_E2M1``
    (cuda_fp4.hpp, ``__nv_cvt_double2_to_fp4x2``: ``.x`` in bits 0-3, ``.y`` in bits 4-7; the
    CUDALibrarySamples cuBLASLt LtNvfp4Matmul sample passes such arrays as A and B), and the
    form ``q`` holds its codes in along K (:mod:`jaxmx._src.core.packing`): only the padding
    nibbles are cleared.
    """
    held = q.held
    first = 2 * lax.broadcasted_iota(jnp.int32, held.shape, held.ndim - 1)  # code 2i's index
    low = jnp.where(first < q.shape[-1], held & jnp.uint8(0x0F), jnp.uint8(0))
    high = jnp.where(first + 1 < q.shape[-1], held & jnp.uint8(0xF0), jnp.uint8(0))
    pad = -(2 * held.shape[-1]) % FP4_K_MULTIPLE // 2
    return jnp.pad(low | high, [(0, 0)] * (held.ndim - 1) + [(0, pad)])


def fp4_scales(q: MXArray) -> jax.Array:
    """uint8 [..., rows, Kp / block]: the compact scale bytes, K padded like the codes (the
    extra blocks get byte 0; their codes are zero)."""
    scale = wire.as_bytes(q.scale, "scales", (jnp.dtype(jnp.uint8), q.format.scale_dtype))
    k = padded_shape(q.shape, q.axis, q.format.block, q.tile)[-1]  # the codes' last dim
    pad = -k % FP4_K_MULTIPLE // q.format.block
    return jnp.pad(scale, [(0, 0)] * (scale.ndim - 1) + [(0, pad)])


def _tensor_scale(q: MXArray, batch: tuple[int, ...]) -> jax.Array:
    """float32 [*batch]: ``q``'s NVFP4 tensor scale (shaped like the leading dims it varies
    over, e.g. under ``vmap``) over the operand's batch dims, or ones for MXFP4."""
    if q.global_scale is None:
        return jnp.ones(batch, jnp.float32)
    g = q.global_scale
    return jnp.broadcast_to(g.reshape(g.shape + (1,) * (len(batch) - g.ndim)), batch)


@functools.cache
def _fp4_call(out_dtype, nvfp4: bool):
    """The FP4 custom call on (a, b, compact scale bytes, tensor scales): rhs rows padded, scales
    swizzled, ``alpha_beta = (float32(g_a * g_b), 0)`` per GEMM (cuBLASLt reads both from
    device memory)."""

    def prepare(a, b, a_scale, b_scale, a_g, b_g):
        b, b_scale, n = pad_rows(b, b_scale, N_MULTIPLE)
        alpha = a_g * b_g
        alpha_beta = jnp.stack([alpha, jnp.zeros_like(alpha)], axis=-1)
        return (a, b, swizzle_scales(a_scale), swizzle_scales(b_scale), alpha_beta), n

    def impl(*args):
        return custom_call(
            FP4_TARGET, "fp4_matmul", out_dtype, prepare, *args, attributes={"nvfp4": nvfp4}
        )

    return jax.jit(vmappable(impl, fold=(True, False, True, False, False, False)))


FP4_KERNEL = Kernel(
    name="native",
    run=lambda a, b, out_dtype, _: fp4_matmul(tn_form(untiled(a)), tn_form(untiled(b)), out_dtype),
    needs="fp4",
    platform="cuda",
)
"""The native FP4 GEMM as a kernel (K-first operands transposed to TN form)."""
