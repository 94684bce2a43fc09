"""What the plain and the diagnosed training steps share: the loss and the rounding context.

:mod:`jaxmx.demo.train` and :mod:`jaxmx.demo.diagnose` both import it (and so not each other:
``train`` imports ``diagnose``).

Example:
    >>> import jax.numpy as jnp
    >>> with rounding(None):                     # nearest rounding: no context at all
    ...     loss = cross_entropy(jnp.zeros((1, 2, 4)), jnp.zeros((1, 2), jnp.int32))
    >>> round(float(loss), 4)                    # log(4)
    1.3863
"""

from __future__ import annotations

import contextlib

import jax
import optax

import jaxmx


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """The mean softmax cross-entropy of ``logits [..., vocab]`` against integer ``targets``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def loss_fn(model, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """The model's next-byte loss (nats per byte) on a batch."""
    return cross_entropy(model(inputs), targets)


def rounding(key: jax.Array | None):
    """``jaxmx.stochastic_rounding(key)`` for the GEMMs in the block, or nothing for ``None``."""
    return contextlib.nullcontext() if key is None else jaxmx.stochastic_rounding(key)
