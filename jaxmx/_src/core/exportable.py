"""A ``custom_partitioning`` op that ``jax.export`` can serialize: a plain form for export.

``jax.export`` cannot serialize a ``custom_partitioning`` rule (XLA calls the rule back in
Python while compiling). :func:`exportable` pairs such an op with a plain-JAX form of the same
computation and chooses between them when the program is lowered: the partitioned op for
``jit``, the plain form when the lowering is for ``jax.export``. Both take the same arguments
and give the same values; they differ only in how XLA partitions them (the plain form leaves
the collectives to XLA's partitioner). The plain form is traced only where it is lowered (for
``jax.export``), so a ``jit`` traces each op's computation once. An export of a program on
several devices that takes the plain form warns once per op, naming it.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmx._src.core.exportable import exportable
    >>> f = exportable(jnp.sin, jnp.sin, "example()")
    >>> exported = jax.export.export(jax.jit(f))(jnp.zeros(2))
    >>> jax.export.deserialize(exported.serialize()).call(jnp.zeros(2)).tolist()
    [0.0, 0.0]
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import batching, mlir

_exportable_p = Primitive("jaxmx_exportable")
_exportable_p.multiple_results = True


def exportable(partitioned: Callable, plain: Callable, where: str) -> Callable:
    """``partitioned(*args)`` under ``jit``; ``plain(*args)`` (same values, no
    ``custom_partitioning``) when lowered for ``jax.export``. ``where`` names the op in the
    export warning. Both functions take and return pytrees of arrays of the same structure."""

    def op(*args):
        flat, tree = jax.tree.flatten(args)
        closed, out_shape = jax.make_jaxpr(
            lambda *a: partitioned(*tree.unflatten(a)), return_shape=True
        )(*flat)
        flat_plain = _Untraced(lambda *a: jax.tree.leaves(plain(*tree.unflatten(a))))
        out = _exportable_p.bind(*flat, partitioned=closed, plain=flat_plain, where=where)
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return op


@dataclasses.dataclass(frozen=True, eq=False)
class _Untraced:
    """A function of flat arrays to a list of arrays, traced only where it is lowered (a
    primitive parameter: hashed and compared by identity)."""

    fn: Callable


def _abstract_eval(*avals, partitioned, plain, where):
    del avals, plain, where
    return partitioned.out_avals


def _impl(*args, partitioned, plain, where):
    del plain, where
    return jax.jit(jaxpr_as_fun(partitioned))(*args)


def _lowering(ctx, *args, partitioned, plain, where):
    for_export = ctx.module_context.lowering_parameters.for_export
    if for_export and getattr(ctx.module_context.axis_context, "num_devices", 1) > 1:
        warnings.warn(
            f"{where}: lowered for jax.export without its custom_partitioning rule (which "
            "jax.export cannot serialize): XLA partitions the plain computation and may gather "
            "sharded operands in high precision instead of as 8-bit codes "
            "(docs/distributed.md, Export)",
            stacklevel=2,
        )
    chosen = plain.fn if for_export else jaxpr_as_fun(partitioned)
    return mlir.lower_fun(chosen, multiple_results=True)(ctx, *args)


def _batched(args, dims, *, partitioned, plain, where):
    moved = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims, strict=True)]
    axes = [0 if d is not None else None for d in dims]
    vmapped = [jax.vmap(f, in_axes=axes) for f in (jaxpr_as_fun(partitioned), plain.fn)]
    out = exportable(*vmapped, where)(*moved)
    return out, [0] * len(out)


_exportable_p.def_abstract_eval(_abstract_eval)
_exportable_p.def_impl(_impl)
mlir.register_lowering(_exportable_p, _lowering)
batching.primitive_batchers[_exportable_p] = _batched
