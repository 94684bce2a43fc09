"""Argument checks shared by every layer: axes and PRNG keys.

Example:
    >>> from jaxmx._src.core.checks import normalize_axis
    >>> normalize_axis(-1, 3)
    2
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp


def normalize_axis(axis: int, ndim: int) -> int:
    """``axis`` of an array of rank ``ndim`` made non-negative; a TypeError for a non-integer,
    a ValueError naming the rank for one out of range."""
    try:
        if isinstance(axis, bool):
            raise TypeError
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"axis must be an integer, got {axis!r}") from None
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {ndim}")
    return axis % ndim


def check_key(key, where: str) -> jax.Array:
    """``key`` if it is a PRNG key (a typed key, or a raw ``uint32[2]`` one), else a TypeError
    naming ``where``."""
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return key
    if dtype == jnp.uint32 and key.shape == (2,):
        return key
    shape = getattr(key, "shape", "")
    raise TypeError(
        f"{where}: key must be a PRNG key (jax.random.key), got "
        f"{dtype or type(key).__name__}{shape}"
    )
