"""The high-precision dtypes jaxmx quantizes from and computes in.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core.dtypes import check_float_dtype
    >>> check_float_dtype(jnp.bfloat16, "example(): out_dtype")
    dtype(bfloat16)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

FLOAT_DTYPES = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16))
"""Inputs of quantize and dot_general, outputs of dequantize and the GEMMs."""


def check_float_dtype(dtype, what: str) -> jnp.dtype:
    """``jnp.dtype(dtype)`` if it is in :data:`FLOAT_DTYPES`, else a TypeError naming ``what``."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{what} must be float32, bfloat16 or float16, got {dtype!r}")
    return dt


def as_array(x, what: str):
    """``jnp.asarray(x)``, or a TypeError naming ``what`` for what is not an array (``None``)."""
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be an array, got {type(x).__name__}") from None


def as_float_array(x, what: str):
    """``jnp.asarray(x)`` if it is a float32, bfloat16 or float16 array, else a TypeError."""
    array = as_array(x, what)
    check_float_dtype(array.dtype, f"{what}'s dtype")
    return array


_UNSIGNED = {4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16}


def to_bits(x: jax.Array) -> jax.Array:
    """A float array narrower than 32 bits viewed as unsigned integers of its width (bit for
    bit; :func:`from_bits` undoes it); any other array as it is.

    The form in which the training GEMMs save their residuals. XLA:CPU computes a
    ``dynamic-update-slice`` of such floats in float32 (or float16): where ``lax.scan`` stacks a
    residual of each step, every step converted and rewrote the whole stack. On integers it
    writes the step's slice in place.

    Example:
        >>> import jax.numpy as jnp
        >>> to_bits(jnp.ones(2, jnp.bfloat16)).tolist(), to_bits(jnp.ones(1)).dtype
        ([16256, 16256], dtype('float32'))
    """
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).bits >= 32:
        return x
    return lax.bitcast_convert_type(x, _UNSIGNED[jnp.finfo(x.dtype).bits])


def from_bits(x: jax.Array, dtype) -> jax.Array:
    """``x`` (a result of :func:`to_bits`) as the ``dtype`` it was made from.

    Example:
        >>> import jax.numpy as jnp
        >>> from_bits(to_bits(jnp.full(2, 0.5, jnp.bfloat16)), jnp.bfloat16).tolist()
        [0.5, 0.5]
    """
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)
