"""The emulated MX GEMM: decode both operands, then ``lax.dot_general`` with float32 accumulation.

Every product of two MX elements (E4M3 / E5M2 / E2M1 code times a power of two) is exact in
float32, so the emulation is the MX definition up to the order of the float32 summation. Two
details keep it there at the edges of the float32 range:

- A row (of either operand) whose largest scale would decode an element past float32's range
  is decoded ``2^s`` lower (``s <= 16``) and its results are multiplied by ``2^s`` afterwards, so
  a GEMM whose exact result is a finite float32 gives it even when an operand alone would not
  fit (e.g. a block at ``2^128`` times one at ``2^-100``).
- Codes in the padding of a K that is not a multiple of the block are ignored, whatever they
  hold.

Operands are fed to the dot as bfloat16 on accelerators (exact: a code times a power of two has
at most 4 significant bits, and bf16 x bf16 products are exact in float32) and as float32 on the
CPU, decided per lowering platform. XLA:CPU flushes float32 subnormals, so there operands,
products and partial sums below ``2^-126`` become zero (the native GEMM keeps them): that only
touches blocks whose two scales multiply to less than about ``2^-110``.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> from jaxmx._src.emulate import emulated_matmul
    >>> a = jaxmx.quantize(jnp.ones((2, 64)))
    >>> b = jaxmx.quantize(jnp.full((3, 64), 0.5))
    >>> emulated_matmul(a, b, jnp.float32).tolist()
    [[32.0, 32.0, 32.0], [32.0, 32.0, 32.0]]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src import bits
from jaxmx._src.mxarray import MXArray
from jaxmx._src.quantize import decode_elements, scale_exponent_bytes


@functools.partial(jax.jit, static_argnums=2)
def emulated_matmul(a: MXArray, b: MXArray, out_dtype) -> jax.Array:
    """``out[..., m, n] = sum_k a[..., m, k] * b[..., n, k]`` on checked MX operands.

    ``a`` is [..., M, K] or [..., K, M] and ``b`` [..., N, K] or [..., K, N], each blocked along
    K; they are contracted in their own layouts (no transposes). Jitted, so eager callers run one
    compiled kernel.
    """

    def run(operand_dtype):
        def gemm(a, b):
            a_values, a_shift = _decode(a, operand_dtype)
            b_values, b_shift = _decode(b, operand_dtype)
            nd = a.data.ndim
            batch = tuple(range(nd - 2))
            out = lax.dot_general(
                a_values,
                b_values,
                (((_k_axis(a),), (_k_axis(b),)), (batch, batch)),
                preferred_element_type=jnp.float32,
            )
            out = out * bits.pow2(a_shift[..., :, None] + b_shift[..., None, :])
            return out.astype(out_dtype)

        return gemm

    return lax.platform_dependent(a, b, cpu=run(jnp.float32), default=run(jnp.bfloat16))


def _k_axis(q: MXArray) -> int:
    """The index of K among the axes of ``q.data``: last, or second to last (K-first)."""
    return q.data.ndim - 1 if q.axis == q.ndim - 1 else q.data.ndim - 2


def _decode(q: MXArray, dtype) -> tuple[jax.Array, jax.Array]:
    """(values in ``dtype``, per-row shift s): ``q``'s values are ``values * 2^s``."""
    f = q.format
    data, k = q.data, _k_axis(q)
    n_blocks = q.scale.shape[k]
    # blocks: [..., rows, KB, block] (K last) or [..., KB, block, rows] (K first)
    blocked = (*data.shape[:k], n_blocks, f.block, *data.shape[k + 1 :])
    values = decode_elements(data, f).reshape(blocked)
    byte = jnp.expand_dims(scale_exponent_bytes(q.scale), k + 1)
    # Rows whose largest finite scale would decode elem_max past float32's range decode lower.
    headroom = 127 - (f.emax + 1)  # elem_max * 2^headroom < 2^128
    finite = jnp.where(byte == bits.E8M0_NAN, 0, byte) - bits.EXPONENT_BIAS
    row_max = jnp.max(finite, axis=(k, k + 1), keepdims=True)  # over K, per row
    shift = jnp.maximum(row_max - headroom, 0)
    exponent = finite - shift
    # 2^exponent in two exact factors, so exponents below -126 give subnormals (not zero)
    scaled = values * bits.pow2(jnp.maximum(exponent, -126))
    scaled = scaled * bits.pow2(jnp.minimum(exponent + 126, 0))
    scaled = jnp.where(byte == bits.E8M0_NAN, jnp.nan, scaled)
    if q.shape[q.axis] != data.shape[k]:  # zero the padding codes along K, whatever they hold
        index = lax.broadcasted_iota(jnp.int32, blocked, k) * f.block + lax.broadcasted_iota(
            jnp.int32, blocked, k + 1
        )
        scaled = jnp.where(index < q.shape[q.axis], scaled, 0)
    shift = jnp.squeeze(shift, (k, k + 1))
    return scaled.reshape(data.shape).astype(dtype), shift
