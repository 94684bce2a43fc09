"""First-order-only markers: the backward passes of jaxmx's GEMMs quantize to integer codes, whose
derivative is zero, so differentiating them again would silently give zeros. Their
high-precision inputs pass through :func:`first_order_only`, an identity whose JVP rule raises on
any non-zero tangent instead.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmx._src.training.higher_order import first_order_only
    >>> first_order_only("example", jnp.ones(2)).tolist()
    [1.0, 1.0]
    >>> jax.jvp(lambda x: first_order_only("example", x), (jnp.ones(2),), (jnp.ones(2),))
    Traceback (most recent call last):
    ...
    NotImplementedError: example: second-order derivatives ...
"""

from __future__ import annotations

import functools

import jax
from jax.custom_derivatives import SymbolicZero


def first_order_only(where: str, *arrays):
    """``arrays`` unchanged (one array for one argument, else a tuple), bit for bit, under
    ``jit``, ``vmap`` and remat; differentiating through them (a non-zero tangent: ``jax.jvp``,
    ``jax.hessian``, ``jax.grad`` of a gradient) raises a NotImplementedError naming ``where``.

    A tangent that is zero but not symbolically so (e.g. one instantiated by ``lax.scan``) raises
    too: the check sees only traced tangents.
    """
    out = tuple(_identity(where, a) for a in arrays)
    return out[0] if len(out) == 1 else out


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _identity(where: str, x):
    """``x``; see :func:`first_order_only`."""
    return x


def _identity_jvp(where: str, primals, tangents):
    """Passes a symbolic zero tangent through; raises on any other."""
    (x,), (t,) = primals, tangents
    if not isinstance(t, SymbolicZero):
        raise NotImplementedError(
            f"{where}: second-order derivatives (jax.hessian, jax.jvp or jax.grad of a gradient) "
            "are not supported: its backward pass quantizes to integer codes, whose derivative "
            "is zero. Use lax.dot_general (or lax.ragged_dot) for the inner derivative."
        )
    return x, t


_identity.defjvp(_identity_jvp, symbolic_zeros=True)
