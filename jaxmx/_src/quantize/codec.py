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
from jax import lax

from jaxmx._src.core import bits
from jaxmx._src.core.formats import Format


def encode(values: jax.Array, f: Format, on_grid: bool = False) -> jax.Array:
    """RNE cast of in-range float32 values to the element dtype (``on_grid``: the values are
    already on the element grid, see :func:`jaxmx._src.core.bits.round_to_grid`)."""
    if f.is_fp8:
        code = bits.encode_fp8(values, f.mbits, f.emin, on_grid)
        return lax.bitcast_convert_type(code, f.dtype)
    return values.astype(f.dtype)


def decode_elements(data: jax.Array, f: Format) -> jax.Array:
    """float32 values of element codes of format ``f``, exactly."""
    if f.is_fp8:
        code = bits.as_bytes(data)
        return bits.decode_fp8(code, f.mbits, f.emin, ieee_specials=f.has_inf)
    return data.astype(jnp.float32)


def scale_exponent_bytes(scale: jax.Array) -> jax.Array:
    """The E8M0 bytes of ``scale`` as int32 (the scale is ``2^(byte - 127)``, 255 is NaN)."""
    return bits.as_bytes(scale, "MX scales", bits.SCALE_DTYPES).astype(jnp.int32)


def scale_back(values: jax.Array, byte: jax.Array) -> jax.Array:
    """``values * 2^(byte - 127)`` exactly (subnormals included), NaN where ``byte`` is 0xFF."""
    k = jnp.minimum(byte, 254) - bits.EXPONENT_BIAS
    return jnp.where(byte == bits.E8M0_NAN, jnp.nan, bits.ldexp_exact(values, k))
