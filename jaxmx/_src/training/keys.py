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

__all__ = ["copy_keys", "gradient_key", "next_key", "require_gradient_key", "stochastic_rounding"]


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


def gradient_key(grad_rounding: str, key: jax.Array | None) -> jax.Array | None:
    """The key a GEMM's gradient rounds with: none for ``"nearest"``, else ``key`` or the next key
    of an enclosing :func:`stochastic_rounding` block (``None`` outside one: only taking a
    gradient needs it, see :func:`require_gradient_key`)."""
    if grad_rounding == "nearest":
        return None
    return next_key() if key is None else key


def require_gradient_key(grad_rounding: str, key: jax.Array | None) -> None:
    """Raises the ValueError that says how to supply a key, when a gradient needs one."""
    if grad_rounding == "stochastic" and key is None:
        raise ValueError(
            "recipe.grad_rounding='stochastic' needs a PRNG key to round the gradient: pass "
            "key=..., or call inside `with jaxmx.stochastic_rounding(key):`"
        )


def copy_keys(key: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
    """The keys of the output gradient's rowwise and columnwise copies: ``fold_in(key, 0)`` and
    ``fold_in(key, 1)`` (``None`` for both without a key)."""
    if key is None:
        return None, None
    return jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
