"""The element and scale codec: float32 values to and from element codes, E8M0 scale bytes.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core.formats import get_format
    >>> from jaxmx._src.quantize.codec import decode_elements, encode
    >>> f = get_format("mxfp8_e4m3")
    >>> decode_elements(encode(jnp.array([1.0, -0.3, 448.0]), f), f).tolist()
    [1.0, -0.3125, 448.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmx._src.core import bits, exponents, minifloat_codec, wire
from jaxmx._src.core.formats import Format


def encode(values: jax.Array, f: Format, on_grid: bool = False) -> jax.Array:
    """RNE cast of in-range float32 values to the element codes (``on_grid``: the values are
    already on the element grid, see :func:`to_grid`)."""
    if f.byte_coded:
        code = minifloat_codec.encode_fp8(values, f.mbits, f.emin, on_grid, width=f.bits)
        return wire.from_bytes(code, f.dtype)
    if f.word_coded:
        return minifloat_codec.encode_fp8(
            values, f.mbits, f.emin, on_grid, width=f.bits, out_dtype=f.dtype
        )
    if f.is_integer:
        return integer_codes(values if on_grid else to_grid(values, f), f)
    return values.astype(f.dtype)


def to_grid(values: jax.Array, f: Format) -> jax.Array:
    """In-range float32 ``values`` rounded to nearest even on ``f``'s element grid: the decoded
    values of their codes (integer elements have no -0: a negative that rounds to zero is +0).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmx._src.core.formats import get_format
        >>> to_grid(jnp.array([0.3, -0.001, 1.0]), get_format("mxint8")).tolist()  # 2^-6 grid
        [0.296875, 0.0, 1.0]
    """
    on_grid = minifloat_codec.round_to_grid(values, f.mbits, f.emin)
    return bits.where(on_grid == 0, 0.0, on_grid) if f.is_integer else on_grid


def integer_codes(on_grid: jax.Array, f: Format) -> jax.Array:
    """The integer codes ``v * 2^mbits`` of values on ``f``'s grid (NaN, which only a block with
    the NaN scale holds, gives code 0).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmx._src.core.formats import get_format
        >>> integer_codes(jnp.array([0.296875, -1.984375]), get_format("mxint8")).tolist()
        [19, -127]
    """
    units = bits.where(jnp.isnan(on_grid), 0.0, on_grid * 2.0**f.mbits)  # exact
    return units.astype(f.dtype)


def decode_elements(data: jax.Array, f: Format) -> jax.Array:
    """float32 values of element codes of format ``f``, exactly."""
    if f.byte_coded:
        code = wire.as_bytes(data)
        return minifloat_codec.decode_fp8(
            code, f.mbits, f.emin, ieee_specials=f.has_inf, width=f.bits
        )
    if f.word_coded:
        return minifloat_codec.decode_fp8(
            data, f.mbits, f.emin, ieee_specials=f.has_inf, width=f.bits
        )
    if f.is_integer:
        return data.astype(jnp.float32) * 2.0**-f.mbits
    return data.astype(jnp.float32)


def scale_exponent_bytes(scale: jax.Array) -> jax.Array:
    """The E8M0 bytes of ``scale`` as int32 (the scale is ``2^(byte - 127)``, 255 is NaN)."""
    return wire.as_bytes(scale, "MX scales", wire.SCALE_DTYPES).astype(jnp.int32)


def scale_back(values: jax.Array, byte: jax.Array) -> jax.Array:
    """``values * 2^(byte - 127)`` exactly (subnormals included), NaN where ``byte`` is 0xFF."""
    k = jnp.minimum(byte, 254) - bits.EXPONENT_BIAS
    return bits.where(byte == exponents.E8M0_NAN, jnp.nan, exponents.ldexp_exact(values, k))
