"""Functions that reshape their inputs, run on arrays whose type carries Explicit mesh axes.

Under ``Explicit`` mesh axes (``jax.make_mesh``'s default, ``jax.set_mesh``) every reshape,
transpose and reduction must say how its output is sharded; the quantizers' block views and the
diagnostics' groupings do not. :func:`on_explicit_axes` runs such a function with the arrays'
Explicit axes switched to Auto (``jax.sharding.auto_axes``, XLA then places the collectives),
and gives each result leaf a layout: the first array's ``PartitionSpec`` for a leaf of the
same rank (each dim keeping only mesh axes that divide it), replicated otherwise. Arrays
without Explicit axes (Auto axes, one device) run as they are.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmx._src.core.explicit_axes import on_explicit_axes
    >>> on_explicit_axes(lambda x: x.reshape(-1).sum(), jnp.ones((2, 4))).item()
    8.0
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def explicit_array(*arrays):
    """The first array among ``arrays`` (a pytree) whose type carries Explicit mesh axes, or
    None."""
    for x in jax.tree.leaves(arrays):
        if not isinstance(x, jax.Array):
            continue
        s = getattr(jax.typeof(x), "sharding", None)
        if isinstance(s, NamedSharding) and AxisType.Explicit in s.mesh.axis_types:
            return x
    return None


def on_explicit_axes(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``; where an array of ``args`` carries Explicit mesh axes, run with
    them switched to Auto, the results laid out as the module docstring says."""
    first = explicit_array(args)
    if first is None:
        return fn(*args, **kwargs)
    sharding = jax.typeof(first).sharding
    mesh, ndim = sharding.mesh, first.ndim
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))

    def layout(leaf):
        if leaf.ndim != ndim:
            return P()
        entries = []
        for entry, n in zip(spec, leaf.shape, strict=True):
            axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            fits = axes and n % math.prod(sizes[a] for a in axes) == 0
            entries.append(entry if fits else None)
        return P(*entries)

    def run(*a):
        return fn(*a, **kwargs)

    with jax.sharding.use_abstract_mesh(mesh):
        shapes = jax.eval_shape(jax.sharding.auto_axes(run, out_sharding=P()), *args)
        out = jax.tree.map(layout, shapes)
        return jax.sharding.auto_axes(run, out_sharding=out)(*args)
