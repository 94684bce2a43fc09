"""The high-precision dtypes jaxmx quantizes from and computes in.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core.dtypes import check_float_dtype
    >>> check_float_dtype(jnp.bfloat16, "example(): out_dtype")
    dtype(bfloat16)
"""

from __future__ import annotations

import jax.numpy as jnp

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
