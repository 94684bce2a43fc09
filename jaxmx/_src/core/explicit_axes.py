"""Functions that reshape their inputs, run on arrays whose type carries Explicit mesh axes.

Under ``Explicit`` mesh axes (``jax.make_mesh``'s default, ``jax.set_mesh``) every reshape,
transpose and reduction must say how its output is sharded; the quantizers' block views and the
diagnostics' groupings do not. :func:`on_explicit_axes` runs such a function with the arrays'
Explicit axes switched to Auto (``jax.sharding.auto_axes``, XLA then places the collectives),
and gives each result leaf a layout: the first array's ``PartitionSpec`` for a leaf of the
same rank (each dim keeping only mesh axes that divide it), replicated otherwise. Arrays
without Explicit axes (Auto axes, one device) run as they are. :func:`on_context_mesh` gives an
array made outside such a function (e.g. a closed-over one) the axis types inside it.

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


def on_context_mesh(tree):
    """``tree`` with each array typed on the current abstract mesh: an array on the same mesh
    with other axis types (made inside ``jax.sharding.auto_axes`` and returned, or made outside
    it and used inside, e.g. closed over) is resharded onto it, keeping its layout's entries on
    the axes that are Explicit there (a traced array's type, a concrete array's placement); the
    others are returned as they are. A traced array's gradient then comes back typed as the
    array is (the ``reshard``'s transpose), as a custom VJP's cotangent must be.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> on_context_mesh({"tap": jnp.zeros(())})["tap"].shape
        ()
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tree
    explicit = set(mesh.explicit_axes)

    def move(x):
        if not isinstance(x, jax.Array):
            return x
        s = jax.typeof(x).sharding
        if not isinstance(s, NamedSharding) or s.mesh.empty or s.mesh == mesh:
            return x
        if s.mesh.axis_names != mesh.axis_names or s.mesh.axis_sizes != mesh.axis_sizes:
            return x
        placed = None if isinstance(x, jax.core.Tracer) else x.sharding
        spec = placed.spec if isinstance(placed, NamedSharding) else s.spec
        entries = []
        for entry in spec:
            axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            entries.append(tuple(a for a in axes if a in explicit) or None)
        return jax.sharding.reshard(x, P(*entries))

    return jax.tree.map(move, tree)
