"""How a training GEMM looks to ``jax.checkpoint`` policies: like the stock ``lax.dot_general``.

A remat policy decides, equation by equation of the forward pass, what to save: the dot policies
save the outputs of ``dot_general`` equations (``dots_with_no_batch_dims_saveable`` only those
without batch dimensions), the name policies the outputs of ``checkpoint_name``. A jaxmx GEMM runs
on canonical ``[B, M, K]`` operands, through dots of its own (the emulation's float32 product) or
a custom call (the native GEMM), so two helpers make it read as the stock dot it replaces:

- :func:`opaque` runs the GEMM's kernels as one equation that the policies see whole: no dot
  inside it is saved for itself;
- :func:`presented_as_dot` passes its result through a ``dot_general`` with the stock GEMM's
  batch dimensions, output shape and dtype: the equation the dot policies save (or offload).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmx._src.training.remat import opaque, presented_as_dot
    >>> y = opaque(lambda a, b: a @ b, jnp.ones((2, 3)), jnp.ones((3, 4)))
    >>> presented_as_dot(y, 0).tolist() == y.tolist()
    True
    >>> jax.make_jaxpr(lambda y: presented_as_dot(y, 0))(y).eqns[-1].primitive.name
    'dot_general'
"""

from __future__ import annotations

import jax
from jax import lax


def opaque(f, *args):
    """``f(*args)`` as one equation (a ``custom_jvp`` call, differentiated as ``f`` is) whose
    inside remat policies do not look into: they decide for its outputs as a whole."""
    hidden = jax.custom_jvp(f)
    hidden.defjvp(lambda primals, tangents: jax.jvp(f, primals, tangents))
    return hidden(*args)


def presented_as_dot(y: jax.Array, n_batch: int) -> jax.Array:
    """``y``, bit for bit, as the output of a ``dot_general`` whose batch dimensions are ``y``'s
    ``n_batch`` leading ones and whose result has ``y``'s shape and dtype.

    The dot contracts a size-1 dimension against a constant one (exact at ``HIGHEST``
    precision; XLA's algebraic simplifier removes it): no GEMM, no copy."""
    batch = tuple(range(n_batch))
    one = lax.full((*y.shape[:n_batch], 1), 1, y.dtype)
    return lax.dot_general(
        y[..., None],
        one,
        (((y.ndim,), (n_batch,)), (batch, batch)),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=y.dtype,
    )
