"""Powers of two in float32, exactly: ``2**k``, exponents and E8M0 scale bytes, ``x * 2**k``.

XLA on CPU flushes float32 subnormals in arithmetic and has no exact ``exp2`` / ``log2``, so
every power of two whose input or result may be subnormal is built from integer operations on
the float32 bits (:mod:`jaxmx._src.core.bits`).

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core import exponents
    >>> exponents.ldexp_exact(jnp.float32(1.0), jnp.int32(-127)).item() == 2.0**-127
    True
    >>> exponents.pow2(jnp.int32(-3)).item()
    0.125
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxmx._src.core.bits import (
    EXPONENT_BIAS,
    MANTISSA_BITS,
    MANTISSA_MASK,
    clip,
    from_bits,
    to_bits,
    where,
)

E8M0_NAN = 0xFF
"""The E8M0 scale byte of a block holding NaN or inf."""


def pow2(k: jnp.ndarray) -> jnp.ndarray:
    """2.0**k in float32 for integer k, exact; 0 below 2^-126 and inf above 2^127."""
    k = k.astype(jnp.int32)
    normal = _normal_pow2(clip(k, 1 - EXPONENT_BIAS, EXPONENT_BIAS + 1))  # 2^128: inf
    return where(k < 1 - EXPONENT_BIAS, jnp.float32(0), normal)


def exponent_and_mantissa(amax_bits: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``(biased exponent, 23-bit mantissa)`` of the non-negative float32 with bits
    ``amax_bits``, subnormals normalized: ``amax = 2^(exponent - 127) * (1 + mantissa / 2^23)``
    for every non-zero finite amax (the exponent is below 1 for a subnormal; zero gives -149
    and mantissa 0). NaN and inf keep their exponent field 0xFF.

    Example:
        >>> import jax.numpy as jnp
        >>> e, m = exponent_and_mantissa(to_bits(jnp.float32(1.5 * 2.0**-130)))
        >>> int(e) - EXPONENT_BIAS, int(m) == 1 << 22     # 1.5 * 2^-130, a subnormal
        (-130, True)
    """
    field = amax_bits >> MANTISSA_BITS
    # a subnormal is m * 2^-149; m < 2^23 converts to float32 exactly, as a normal float
    m_bits = to_bits((amax_bits & MANTISSA_MASK).astype(jnp.float32))
    exponent = where(field == 0, (m_bits >> MANTISSA_BITS) - 149, field)
    mantissa = where(field == 0, m_bits & MANTISSA_MASK, amax_bits & MANTISSA_MASK)
    return exponent, mantissa


def scale_bytes(amax_bits: jnp.ndarray, emax: int, increment: jnp.ndarray) -> jnp.ndarray:
    """The E8M0 byte ``clamp(exponent(amax) + increment - emax, -127, 127) + 127`` (or 0xFF).

    ``amax_bits`` are the float32 bits of a non-negative amax (NaN/Inf have exponent 0xFF and map
    to the NaN byte); the exponent is ``floor(log2(amax))``, subnormals included
    (:func:`exponent_and_mantissa`). A zero amax yields byte 0, the smallest scale.

    Where ``emax >= 1`` a subnormal amax gives byte 0 with or without normalizing (its exponent
    is at most 0, the increment at most 1), so its exponent field is taken as it is.
    """
    exponent = exponent_and_mantissa(amax_bits)[0] if emax < 1 else amax_bits >> MANTISSA_BITS
    byte = clip(exponent + increment.astype(jnp.int32) - emax, 0, 254)
    return where(exponent == 0xFF, E8M0_NAN, byte)


def scale_by_pow2(x: jnp.ndarray, k: jnp.ndarray, axis: int | None = None) -> jnp.ndarray:
    """``x * 2**k`` for float32 x and integer k in [-127, 127], exact for subnormal x (k below
    -127 gives zero: the NaN-scale blocks' ``k = -128``).

    Results below 2^-126 are flushed to zero, which is harmless here: they are far below half
    the smallest subnormal of every MX element format and round to zero anyway. ``k = -127``
    (the largest block exponent where emax is 0: MXINT8) is applied to the exponent field, as
    no float32 factor (nor a product of two, which XLA may fold) is 2^-127 without flushing.

    ``axis``: ``k`` holds one exponent per block, without ``x``'s axis ``axis`` (the block's
    elements); its factors are computed per block and expanded there, where they meet the
    elements, so XLA has no reshape to sink through their arithmetic.
    """
    per_element = (lambda v: v) if axis is None else (lambda v: jnp.expand_dims(v, axis))
    bits = to_bits(x)
    is_subnormal = (bits & 0x7F800000) == 0
    magnitude = (bits & MANTISSA_MASK).astype(jnp.float32)  # the subnormal as an integer * 2^-149
    from_subnormal = where(bits < 0, -magnitude, magnitude) * per_element(pow2(k - 149))
    exponent = (bits >> MANTISSA_BITS) & 0xFF
    by_field = per_element(k == -127) & (exponent > 127) & (exponent < 0xFF)  # a normal result
    normal = where(by_field, from_bits(bits - (127 << MANTISSA_BITS)), x * per_element(pow2(k)))
    return where(is_subnormal, from_subnormal, normal)


def ldexp_exact(value: jnp.ndarray, k: jnp.ndarray) -> jnp.ndarray:
    """``value * 2**k`` in float32, exact including subnormal and infinite results.

    ``value`` is a decoded element (at most 24 significant bits, normal in float32 or zero), ``k``
    an integer in [-127, 127]. Built from the bits, so no flushing: e.g. 1.0 * 2^-127 gives the
    float32 subnormal 2^-127.
    """
    bits = to_bits(value)
    sign = bits & jnp.int32(-(2**31))
    exponent = (bits >> MANTISSA_BITS) & 0xFF
    new_exponent = exponent + k
    normal = bits + (k << MANTISSA_BITS)
    significand = (bits & MANTISSA_MASK) | (1 << MANTISSA_BITS)
    shift = clip(1 - new_exponent, 0, 31)
    subnormal = sign | (significand >> shift)
    out = where(new_exponent >= 1, normal, subnormal)
    out = where(new_exponent >= 0xFF, sign | 0x7F800000, out)
    passthrough = (exponent == 0) | (exponent == 0xFF)  # zeros, NaN and inf elements
    return from_bits(where(passthrough, bits, out))


def ldexp_rounded(x: jnp.ndarray, k: jnp.ndarray) -> jnp.ndarray:
    """``x * 2**k`` in float32 rounded once to nearest even, subnormal results included.

    ``x`` is any float32 (zeros, NaN and infinities pass through), ``k`` an integer; a result
    past float32's range is inf. Built from the bits, so XLA:CPU does not flush: e.g.
    ``5 * 2^-151`` (1.25 units of the smallest subnormal) gives ``2^-149``, where the float
    product would be zero there.
    """
    bits = to_bits(x)
    sign = bits & jnp.int32(-(2**31))
    exponent = (bits >> MANTISSA_BITS) & 0xFF
    significand = (bits & MANTISSA_MASK) | where(exponent > 0, 1 << MANTISSA_BITS, 0)
    # a subnormal x, normalized: the leading bit moved to bit 23, the exponent lowered to match
    lead = jnp.maximum(lax.clz(significand) - (31 - MANTISSA_BITS), 0)
    significand = significand << lead
    new_exponent = jnp.maximum(exponent, 1) - lead + k
    field = clip(new_exponent, 1, 0xFE) << MANTISSA_BITS
    normal = sign | field | (significand & MANTISSA_MASK)
    s = clip(1 - new_exponent, 1, 26)  # the right shift into the subnormal range
    q = significand >> s
    rest = significand & ((1 << s) - 1)
    half = 1 << (s - 1)
    q = q + ((rest > half) | ((rest == half) & ((q & 1) == 1))).astype(jnp.int32)
    out = where(new_exponent >= 1, normal, sign | q)  # a carry to 2^23 is 2^-126: right
    out = where(new_exponent > 0xFE, sign | 0x7F800000, out)
    passthrough = (exponent == 0xFF) | ((bits & 0x7FFFFFFF) == 0)
    return from_bits(where(passthrough, bits, out))


def times_pow2(x: jnp.ndarray, k: jnp.ndarray) -> jnp.ndarray:
    """``x * 2**k`` in float32 rounded once to nearest even, subnormal results included, for
    ``x`` zero, normal, inf or NaN and an integer ``k`` in [-254, 254]: :func:`ldexp_rounded`
    in fewer operations, where ``x`` is not a float32 subnormal (a dot's result on XLA:CPU,
    which flushes them; a subnormal ``x`` is exact on platforms that keep it, else taken as
    0).

    A normal result is ``x`` times three normal powers of two (exact; inf past float32's
    range); a subnormal one is ``|x| * 2^(k + 149)``, below ``2^23``, rounded to an integer: the
    result's bits.

    Example:
        >>> import jax.numpy as jnp
        >>> times_pow2(jnp.float32(5.0), jnp.int32(-151)).item() == 2.0**-149  # 1.25 units
        True
    """
    k = k.astype(jnp.int32)
    x_bits = to_bits(x)
    biased = (x_bits >> MANTISSA_BITS) & 0xFF
    first = clip(k, -126, 127)
    second = clip(k - first, -126, 127)
    normal = x * _normal_pow2(first) * _normal_pow2(second) * _normal_pow2(k - first - second)
    # a subnormal result (k <= 0 there): |x| in units of 2^-149, below 2^23 (exact unless
    # below 2^-126, where the result rounds to zero anyway; k + 149 - up is then in [0, 22]),
    # rounded to an integer
    up = clip(k + 149, -126, 127)
    units = from_bits(x_bits & 0x7FFFFFFF) * _normal_pow2(up) * _normal_pow2(k + 149 - up)
    units = lax.round(units, lax.RoundingMethod.TO_NEAREST_EVEN).astype(jnp.int32)
    subnormal = from_bits((x_bits & jnp.int32(-(2**31))) | units)
    return where(biased + k < 1, subnormal, normal)


def _normal_pow2(k: jnp.ndarray) -> jnp.ndarray:
    """``2.0**k`` for integer ``k`` in [-126, 127] (a normal float32; 128 gives inf), from its
    bits."""
    return from_bits((k + EXPONENT_BIAS) << MANTISSA_BITS)
