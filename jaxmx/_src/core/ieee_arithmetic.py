"""float32 products and quotients rounded once to nearest even, where XLA would not.

XLA:CPU flushes subnormal products to zero (:func:`multiply_exact` computes them from
integers) and turns a division by a broadcast value into a multiplication by its reciprocal
(:func:`divide` keeps the division).

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core.ieee_arithmetic import divide, multiply_exact
    >>> divide(jnp.float32(1.0), jnp.float32(3.0)).item() == float(jnp.float32(1 / 3))
    True
    >>> multiply_exact(jnp.float32(0.5), jnp.float32(2.0**-126)).item() == 2.0**-127  # subnormal
    True
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxmx._src.core.bits import MANTISSA_BITS, MANTISSA_MASK, clip, from_bits, to_bits, where


def divide(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """``a / b`` in float32, rounded to nearest even as IEEE division is (broadcast shapes).

    Where ``/`` alone is not: XLA turns a division by a broadcast value into a multiplication
    by its rounded reciprocal (one ulp off), so the divisor is materialised at the quotient's
    shape (batched under ``jax.vmap`` as the dividend is) behind an optimization barrier.
    """
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    return jnp.broadcast_to(a, shape) / lax.optimization_barrier(_batched_like(b, a, shape))


def _batched_like(b: jnp.ndarray, a: jnp.ndarray, shape) -> jnp.ndarray:
    """``b`` broadcast to ``shape``, computed from ``a`` too, so that under ``jax.vmap`` it is
    batched wherever ``a`` is: an unbatched divisor would be broadcast only after
    :func:`divide`'s barrier, where XLA again multiplies by its reciprocal. The bits of ``a``
    are masked out (``& 0``), so the values are ``b``'s, NaN and infinities included. Both are
    read as bits before their broadcast: a constant operand leaves XLA no work at ``shape``."""
    b_bits = jnp.broadcast_to(to_bits(b), shape)
    return from_bits(b_bits | jnp.broadcast_to(to_bits(a) & 0, shape))


def multiply_exact(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """``a * b`` in float32, rounded to nearest even including subnormal results.

    ``a`` has at most 7 significant bits (e.g. a decoded element times a decoded E4M3 scale) and
    both are normal, zero, infinite or NaN. Products of at least ``2^-126`` come from the float
    multiply; smaller ones, which XLA:CPU would flush to zero, from integers: the product of the
    significands (< 2^31) shifted right with round to nearest even, whose bits are the subnormal
    result.
    """
    product = a * b
    a_bits, b_bits = to_bits(a), to_bits(b)
    a_exp = (a_bits >> MANTISSA_BITS) & 0xFF
    b_exp = (b_bits >> MANTISSA_BITS) & 0xFF
    a_int = ((a_bits & MANTISSA_MASK) | (1 << MANTISSA_BITS)) >> 17  # 7 bits, exact
    b_int = (b_bits & MANTISSA_MASK) | (1 << MANTISSA_BITS)
    p = a_int * b_int  # < 2^31; |a * b| = p * 2^(a_exp + b_exp - 283), biased exponents
    shift = 134 - a_exp - b_exp  # p * 2^-shift in units of 2^-149
    s = clip(shift, 1, 30)
    q = p >> s
    rest = p & ((1 << s) - 1)
    half = 1 << (s - 1)
    q = q + ((rest > half) | ((rest == half) & ((q & 1) == 1))).astype(jnp.int32)
    q = where(shift == 31, (p > (1 << 30)).astype(jnp.int32), q)
    q = where(shift > 31, 0, q)
    sign = (a_bits ^ b_bits) & jnp.int32(-(2**31))
    tiny = from_bits(q | sign)
    normal_inputs = (a_exp > 0) & (a_exp < 0xFF) & (b_exp > 0) & (b_exp < 0xFF)
    return where(normal_inputs & (shift >= 7), tiny, product)
