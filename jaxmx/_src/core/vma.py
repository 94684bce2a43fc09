"""``shard_map`` support: which mesh axes a value varies over (its "vma"), and marking results.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core.vma import varying_axes
    >>> varying_axes(jnp.ones(3))
    frozenset()
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset:
    """The ``shard_map`` mesh axes along which ``x`` varies (its "vma"; empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vary_like(out: jax.Array, *inputs: jax.Array) -> jax.Array:
    """``out`` marked as varying over every ``shard_map`` axis along which an input varies.

    A custom call's results carry no such marks, so without this a GEMM of per-device operands
    would look replicated, and autodiff would skip the sums its transpose needs.
    """
    want = frozenset().union(*(varying_axes(x) for x in inputs))
    missing = tuple(sorted(want - varying_axes(out)))
    return lax.pcast(out, missing, to="varying") if missing else out
