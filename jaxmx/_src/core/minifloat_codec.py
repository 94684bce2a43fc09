"""The integer codec of narrow floats: FP8 (E4M3, E5M2), FP6 and E5M6 codes from float32 and back.

Integer arithmetic on the float32 bits gives the same codes as XLA's convert (in about half its
time on XLA:CPU), covers the formats XLA has no dtype for (FP6, the 12-bit E5M6), and runs in
Pallas kernels. :func:`round_to_grid` rounds to a format's grid without encoding.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core import minifloat_codec
    >>> code = minifloat_codec.encode_fp8(jnp.float32(-1.5), mbits=3, emin=-6)  # E4M3
    >>> hex(int(code)), minifloat_codec.decode_fp8(code, 3, -6, ieee_specials=False).item()
    ('0xbc', -1.5)
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxmx._src.core.bits import EXPONENT_BIAS, MANTISSA_BITS, from_bits, to_bits, where


def round_to_grid(v: jnp.ndarray, mbits: int, emin: int) -> jnp.ndarray:
    """float32 ``v`` rounded to nearest even on the grid of a float format with ``mbits``
    mantissa bits and smallest normal ``2^emin`` (subnormals included, no upper limit).

    The grid step of ``|v|`` is ``q = 2^(max(exponent(v), emin) - mbits)``. Adding ``M = 2^23 q``
    puts ``|v| < M`` in the binade of M, whose float32 spacing is q, so the sum rounds ``|v|`` to
    a multiple of q (ties to even) and subtracting M is exact. (M depends on ``v``: XLA folds
    ``(x + c) - c`` for a constant c.) Float32 subnormal ``v`` round to zero. The sign is copied
    from ``v``'s bits, so negatives that round to zero give -0, as element codes do.
    """
    v_bits = to_bits(v)
    magnitude = from_bits(v_bits & 0x7FFFFFFF)
    exponent = ((v_bits >> MANTISSA_BITS) & 0xFF) - EXPONENT_BIAS
    step_exponent = jnp.maximum(exponent, emin) - mbits
    big = from_bits((step_exponent + MANTISSA_BITS + EXPONENT_BIAS) << MANTISSA_BITS)
    rounded = (magnitude + big) - big
    return from_bits(to_bits(rounded) | (v_bits & jnp.int32(-(2**31))))


def encode_fp8(
    v: jnp.ndarray,
    mbits: int,
    emin: int,
    on_grid: bool = False,
    width: int = 8,
    out_dtype=jnp.uint8,
) -> jnp.ndarray:
    """Bytes of the ``width``-bit float (sign, exponent, ``mbits`` mantissa bits, min normal
    2^emin; 8 bits, or 6 for FP6 in the low bits of a byte; 12 for E5M6 in the low bits of a
    ``uint16``, with ``out_dtype=jnp.uint16``) nearest to ``v`` (round to nearest even), for
    float32 ``v`` within the format's finite range.

    Integer arithmetic on the float32 bits: the same bytes as XLA's convert, in about half its
    time on XLA:CPU. NaN becomes the all-ones magnitude (NaN in E4M3 and E5M2, the largest
    finite value in FP6, which has no NaN). ``on_grid``: ``v`` is already on the format's grid
    (:func:`round_to_grid`), so no rounding is done (and no ``round`` primitive used, which
    Pallas' Triton lowering lacks).
    """
    bits = to_bits(v)
    sign = (bits >> (32 - width)) & (1 << (width - 1))
    magnitude_bits = bits & 0x7FFFFFFF
    magnitude = from_bits(magnitude_bits)
    shift = MANTISSA_BITS - mbits
    # normal range: round the mantissa to mbits bits (ties to even), then rebias the exponent
    rounded = magnitude_bits + (1 << (shift - 1)) - 1 + ((magnitude_bits >> shift) & 1)
    normal = (rounded >> shift) - ((EXPONENT_BIAS - (1 - emin)) << mbits)
    # subnormal range: a multiple of the smallest subnormal, 2^(emin - mbits)
    subnormal = magnitude * 2.0 ** (mbits - emin)
    if not on_grid:
        subnormal = lax.round(subnormal, lax.RoundingMethod.TO_NEAREST_EVEN)
    code = where(magnitude < 2.0**emin, subnormal.astype(jnp.int32), normal)
    code = where(jnp.isnan(v), (1 << (width - 1)) - 1, code) | sign
    return code.astype(out_dtype)


def decode_fp8(
    code: jnp.ndarray, mbits: int, emin: int, ieee_specials: bool, width: int = 8
) -> jnp.ndarray:
    """float32 values of ``width``-bit float bytes (the inverse of :func:`encode_fp8`), exactly.

    ``ieee_specials``: the all-ones exponent holds inf and NaN (E5M2, E5M6); otherwise only the
    all-ones magnitude is NaN (E4M3), or, for 6-bit floats, nothing is (FP6 has no specials).
    """
    code = code.astype(jnp.int32)
    sign_bit = 1 << (width - 1)
    sign = (code & sign_bit) << (32 - width)
    magnitude = code & (sign_bit - 1)
    shift = MANTISSA_BITS - mbits
    normal = (magnitude + ((EXPONENT_BIAS - (1 - emin)) << mbits)) << shift
    subnormal = to_bits(magnitude.astype(jnp.float32) * 2.0 ** (emin - mbits))
    out = from_bits(where(magnitude < (1 << mbits), subnormal, normal) | sign)
    if ieee_specials:
        top = sign_bit - (1 << mbits)  # exponent all ones, mantissa zero: inf
        out = where(magnitude == top, where(sign != 0, -jnp.inf, jnp.inf), out)
        return where(magnitude > top, jnp.nan, out)
    if width < 8:
        return out
    return where(magnitude == sign_bit - 1, jnp.nan, out)
