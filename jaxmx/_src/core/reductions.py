"""The maximum over a long axis, in steps XLA:CPU keeps fused with what it reduces.

XLA:CPU rewrites a reduction over more than 32 elements into a ``reduce-window`` of 32 and a
reduction of its result (its tree-reduction rewriter). The ``reduce-window`` is not fused with
its operand, so the operand is materialized whole: the amax of a per-row, per-tensor or
128-block scale computed from the float32 bits of a tensor held a full ``int32`` copy of that
tensor (a megabyte for a ``[256, 1024]`` weight) in every training step. :func:`max_along`
reduces 32 elements at a time instead, each step's result (a 32nd of its input) kept apart
from the next by an ``optimization_barrier`` (XLA would merge the steps into one reduction
again), so the first step is fused with the computation of its operand and nothing of the
operand's size is held. The maximum is the same value: ``max`` is exact in any order. Inside a
Pallas kernel (:func:`in_one_step`) the reduction is one operation: Triton lowers no
``optimization_barrier``, and no XLA rewrite applies there.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core.reductions import max_along
    >>> x = jnp.arange(2 * 100).reshape(2, 100)
    >>> max_along(x, 1).tolist(), max_along(x, keepdims=True).tolist()
    ([99, 199], [[199]])
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from jax import lax

STEP = 32
"""Elements one reduction step takes: XLA:CPU's rewrite leaves reductions this size alone."""

_ONE_STEP = contextvars.ContextVar("jaxmx_max_in_one_step", default=False)


@contextlib.contextmanager
def in_one_step():
    """Within the block, :func:`max_along` reduces in one operation (for a Pallas kernel's
    body, traced in the block)."""
    token = _ONE_STEP.set(True)
    try:
        yield
    finally:
        _ONE_STEP.reset(token)


def max_along(x: jax.Array, axis=None, *, keepdims: bool = False, neutral=0):
    """``jnp.max(x, axis, keepdims=keepdims)`` over ``axis`` (an int, a tuple of ints, or
    None for every axis), in steps of :data:`STEP` elements; ``neutral`` pads an axis that is
    not a whole number of steps and is the result over an empty axis (``jnp.max``'s
    ``initial``: no element of ``x`` may exceed it from below, e.g. 0 for magnitudes or their
    bits)."""
    axes = range(x.ndim) if axis is None else (axis,) if isinstance(axis, int) else axis
    axes = sorted(a % x.ndim for a in axes)
    for a in axes:
        x = _max_along_one(x, a, neutral)
    return x if keepdims else jnp.squeeze(x, axes)


def _max_along_one(x: jax.Array, axis: int, neutral) -> jax.Array:
    """The maximum over ``axis``, kept as an axis of size 1."""
    while x.shape[axis] > STEP and not _ONE_STEP.get():
        steps = math.ceil(x.shape[axis] / STEP)
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, steps * STEP - x.shape[axis])
        if pad[axis][1]:
            x = jnp.pad(x, pad, constant_values=neutral)
        x = x.reshape(*x.shape[:axis], steps, STEP, *x.shape[axis + 1 :])
        x = lax.optimization_barrier(jnp.max(x, axis=axis + 1))
    return jnp.max(x, axis=axis, keepdims=True, initial=neutral)
