"""The float32 bit fields, and a ``where`` that broadcasts no literal.

The field widths (:data:`MANTISSA_BITS`, :data:`EXPONENT_BIAS`), the int32 view of float32 and
back, the exact upcast of bfloat16 (from its bits), and :func:`where`: ``jnp.where`` with each
constant operand filled in from another operand's bits (:func:`filled_like`), so that no
loop-invariant constant becomes a residual.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core import bits
    >>> int(bits.to_bits(jnp.float32(1.0)) >> bits.MANTISSA_BITS) - bits.EXPONENT_BIAS
    0
    >>> bits.where(jnp.array([True, False]), 0.5, jnp.array([1.0, 2.0])).tolist()
    [0.5, 2.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

MANTISSA_BITS = 23
MANTISSA_MASK = (1 << MANTISSA_BITS) - 1
EXPONENT_BIAS = 127


def where(condition, x, y) -> jnp.ndarray:
    """``jnp.where(condition, x, y)``, with a constant operand (a Python or 0-d scalar) filled in
    from the other operands' elements instead of broadcast from a literal (:func:`filled_like`).

    A literal broadcast depends on nothing, so JAX's partial evaluation puts it in the known part
    of a linearized or rematerialized function, where it becomes a residual; ``lax.scan`` hoists
    such a loop-invariant residual out of the loop, materialized at full size (one float32 or
    int32 per element of every quantized tensor). The filled constant is the same value, and XLA
    folds it back to a broadcast inside the loop.

    Example:
        >>> import jax.numpy as jnp
        >>> where(jnp.array([True, False]), 128, jnp.array([1, 2])).tolist()
        [128, 2]
    """
    constant = [_is_constant(v) for v in (x, y)]
    if any(constant):
        dtype = jnp.result_type(x, y)
        arrays = [v for v, c in zip((x, y), constant, strict=True) if not c]
        ref = arrays[0] if arrays else jnp.asarray(condition)
        x, y = (
            filled_like(ref, v, dtype) if c else v for v, c in zip((x, y), constant, strict=True)
        )
    return _select(condition, x, y)


def _select(condition, x, y) -> jnp.ndarray:
    """``jnp.where(condition, x, y)`` for arrays, as a plain ``select``: ``jnp.where`` is a
    jitted function, which each call nests in the program as a function of its own (a call
    XLA then inlines: hundreds per training step). The operands broadcast as ``jnp.where``'s
    do, explicit shardings included."""
    x, y = jnp.asarray(x), jnp.asarray(y)
    dtype = jnp.result_type(x, y)
    condition = jnp.asarray(condition, jnp.bool_)
    return lax.select(*jnp.broadcast_arrays(condition, x.astype(dtype), y.astype(dtype)))


def clip(x: jnp.ndarray, low, high) -> jnp.ndarray:
    """``jnp.clip(x, low, high)`` for scalar bounds, as plain ``max`` and ``min`` (``jnp.clip``
    is a jitted function: see :func:`where`); NaN stays NaN.

    Example:
        >>> clip(jnp.array([-3, 0, 9]), -1, 2).tolist()
        [-1, 0, 2]
    """
    x = jnp.asarray(x)
    return lax.min(lax.max(x, jnp.asarray(low, x.dtype)), jnp.asarray(high, x.dtype))


def filled_like(ref: jnp.ndarray, value, dtype) -> jnp.ndarray:
    """``value`` in ``dtype``, shaped like ``ref`` and computed from its bits (``bits & 0 | value``,
    exact; XLA folds it to a broadcast of ``value``)."""
    dtype = jnp.dtype(dtype)
    unsigned = jnp.dtype(f"uint{dtype.itemsize * 8}")
    ref = jnp.asarray(ref)
    if ref.dtype == jnp.bool_:
        ref_bits = ref.astype(unsigned)
    else:
        ref_bits = lax.bitcast_convert_type(ref, jnp.dtype(f"uint{ref.dtype.itemsize * 8}"))
        ref_bits = ref_bits.astype(unsigned)
    pattern = np.asarray(value, dtype).view(unsigned)
    out = (ref_bits & unsigned.type(0)) | pattern
    return out.astype(dtype) if dtype == jnp.bool_ else lax.bitcast_convert_type(out, dtype)


def _is_constant(v) -> bool:
    """Whether ``v`` is a scalar known at trace time (a Python or NumPy scalar, a 0-d array)."""
    if isinstance(v, (bool, int, float, np.generic)):
        return True
    return (
        isinstance(v, (np.ndarray, jax.Array))
        and np.ndim(v) == 0
        and not isinstance(v, jax.core.Tracer)
    )


def to_bits(x: jnp.ndarray) -> jnp.ndarray:
    """float32 -> its int32 bit pattern."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def from_bits(bits: jnp.ndarray) -> jnp.ndarray:
    """int32 bit pattern -> float32."""
    return lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def upcast_exact(x: jnp.ndarray) -> jnp.ndarray:
    """Converts float16/bfloat16/float32 to float32 exactly, subnormals included."""
    if x.dtype == jnp.bfloat16:
        bits16 = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32)
        return from_bits(bits16 << 16)
    return x.astype(jnp.float32)
