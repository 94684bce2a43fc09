"""PRNG keys for stochastic rounding, supplied to every jaxmx GEMM in a block of code.

Layers (Flax or not) call :func:`jaxmx.dot_general` without a ``key``. Inside
``with jaxmx.stochastic_rounding(key):`` each call that needs a key and was given none gets
``fold_in(key, i)``, with ``i`` counting those calls in trace order, so every GEMM draws
different rounding noise. Enter the block inside the function you ``jit`` (the key is a traced
value) and pass a fresh key each step.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> recipe = jaxmx.recipes.MXFP8.replace(grad_rounding="stochastic")
    >>> def loss(w, x, key):
    ...     with jaxmx.stochastic_rounding(key):
    ...         return jaxmx.dot_general(x, w, (((1,), (1,)), ((), ())), recipe=recipe).sum()
    >>> g = jax.jit(jax.grad(loss))(jnp.ones((4, 32)), jnp.ones((8, 32)), jax.random.key(0))
    >>> g.shape
    (4, 32)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax

__all__ = ["next_key", "stochastic_rounding"]


@dataclasses.dataclass
class _Source:
    key: jax.Array
    count: int = 0


_source: contextvars.ContextVar[_Source | None] = contextvars.ContextVar("jaxmx_key", default=None)


@contextlib.contextmanager
def stochastic_rounding(key: jax.Array):
    """Supplies ``fold_in(key, i)`` to the i-th keyless stochastic-rounding GEMM in the block.

    A GEMM inside a ``lax.scan`` / ``nnx.scan`` body is traced once, so all iterations share its
    key: to vary it, enter the block inside the body with ``fold_in(key, step_index)``.
    """
    token = _source.set(_Source(key))
    try:
        yield
    finally:
        _source.reset(token)


def next_key() -> jax.Array | None:
    """The next key of the innermost :func:`stochastic_rounding` block, or ``None`` outside."""
    source = _source.get()
    if source is None:
        return None
    source.count += 1
    return jax.random.fold_in(source.key, source.count - 1)
