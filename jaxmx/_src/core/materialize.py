"""What XLA holds in memory, and when it computes it: two bit-for-bit identities it cannot see
through.

:func:`materialized` holds an array as it is, not as what it was computed from. XLA fuses
cheap elementwise operations into each of their consumers and holds the result of the last
expensive one (a floating-point division, say) where consumers meet. Codes computed as
``convert(x / s)`` and read by two GEMMs (a weight's tiles serve the forward GEMM and the input
gradient's) are then held across the training step as the float32 quotients ``x / s``: four
bytes an element where the codes take one. :func:`materialized` ends the computation of an
array with an operation that XLA does not repeat in each consumer, an unsigned integer division
by 1, so XLA holds the array itself. The divisor is computed at run time from another array's
bits (``(bits >> (width - 1)) | 1``, which is 1 for every value), so no pass folds it away; the
result equals the input bit for bit. (``lax.optimization_barrier`` does not do this: XLA:CPU
removes it before fusion.)

:func:`tied` makes an unsigned integer array depend on another array, so that it is computed
where that array exists: ``min(v, v | b)`` with ``b`` the bits of the other array's first
element, which is ``v``. A weight's decode depends on the weight only, and XLA's scheduler
decodes it (and holds the result) at the start of the step unless its scales are tied to the
GEMM's input or output gradient; a stochastic rounding draw depends on the key and the
element's position only, and JAX and XLA move it out of a ``lax.scan`` (a full-size array held
across the loop) unless its index is tied to the array it rounds.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core.materialize import materialized, tied
    >>> codes = jnp.array([1.5, -448.0, jnp.nan], jnp.float8_e4m3fn)
    >>> materialized(codes, one_from=jnp.float32(0.25)).tolist()
    [1.5, -448.0, nan]
    >>> tied(jnp.array([0, 7, 255], jnp.uint8), to=jnp.float32(-1.0)).tolist()
    [0, 7, 255]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def materialized(x: jax.Array, *, one_from: jax.Array) -> jax.Array:
    """``x``, bit for bit, computed last by an integer division by a 1 made at run time from the
    first element of ``one_from`` (any non-empty array XLA does not know as a constant, e.g.
    the scales computed with ``x``). ``x``: a dtype of 8, 16 or 32 bits; an empty ``x`` is
    returned as it is."""
    bits = _bits(x.dtype)
    if bits not in (8, 16, 32):
        raise TypeError(f"materialized: takes arrays of 8, 16 or 32-bit elements, not {x.dtype}")
    if x.size == 0:
        return x
    unsigned = jnp.dtype(f"uint{bits}")
    as_unsigned = lax.bitcast_convert_type(x, unsigned)
    out = lax.div(as_unsigned, _one(one_from).astype(unsigned))
    return lax.bitcast_convert_type(out, x.dtype)


def tied(v: jax.Array, *, to: jax.Array) -> jax.Array:
    """``v`` (unsigned integers), bit for bit, computed after ``to``: ``min(v, v | b)`` for
    ``b`` the bits of ``to``'s first element (as float32). ``v`` itself for an empty ``to``."""
    if to.size == 0:
        return v
    bits = lax.bitcast_convert_type(_first(to).astype(jnp.float32), jnp.uint32).astype(v.dtype)
    return jnp.minimum(v, v | bits)


def _one(source: jax.Array) -> jax.Array:
    """An unsigned scalar 1: the top bit of ``source``'s first element, or 1."""
    first = _first(source)
    bits = _bits(first.dtype)
    word = lax.bitcast_convert_type(first, jnp.dtype(f"uint{bits}"))
    return (word >> (bits - 1)) | 1


def _first(x: jax.Array) -> jax.Array:
    """``x``'s first element, a scalar (a slice: no gather)."""
    return lax.slice(x, (0,) * x.ndim, (1,) * x.ndim).reshape(())


def _bits(dtype) -> int:
    """Bits an element of ``dtype`` holds (a ValueError for bool)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.finfo(dtype).bits
    return jnp.iinfo(dtype).bits
