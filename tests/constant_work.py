"""What a jitted program hands XLA to evaluate while compiling: the equations of its jaxpr that
compute on constants only (nothing derived from the program's arguments), with an operand or
a result of many elements. XLA's constant folding evaluates such an equation element by
element at compile time (its "slow_operation_alarm" when that takes over a second).

A broadcast or an iota of constants is not listed (XLA keeps them unevaluated); what consumes
one is. ``optimization_barrier`` makes its outputs non-constant, as it does in XLA.
"""

from __future__ import annotations

import math

import jax
from jax.extend import core

_KEPT = {"broadcast_in_dim", "iota", "reshape", "squeeze", "expand_dims", "convert_element_type"}


def constant_work(fn, *args, min_elements: int = 1024) -> list[str]:
    """``[primitive and shapes]`` of each equation of ``jax.make_jaxpr(fn)(*args)`` that XLA
    would evaluate at compile time on an operand or result of ``min_elements`` or more."""
    closed = jax.make_jaxpr(fn)(*args)
    found: list[str] = []
    _walk(closed.jaxpr, [True] * len(closed.jaxpr.invars), min_elements, found)
    return found


def _size(v) -> int:
    shape = getattr(v.aval, "shape", ())
    return math.prod(shape)


def _subjaxprs(params):
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else [value]:
            if isinstance(item, core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, core.Jaxpr):
                yield item


def _walk(jaxpr, traced_in, min_elements, found) -> None:
    traced = {v for v, t in zip(jaxpr.invars, traced_in, strict=True) if t}
    for eqn in jaxpr.eqns:
        ins = [isinstance(v, core.Var) and v in traced for v in eqn.invars]
        name = eqn.primitive.name
        subs = list(_subjaxprs(eqn.params))
        if name == "optimization_barrier":
            out = True
        elif subs:
            for sub in subs:
                inner = ins if len(sub.invars) == len(ins) else [True] * len(sub.invars)
                _walk(sub, inner, min_elements, found)
            out = any(ins)
        else:
            out = any(ins)
            big = max([_size(v) for v in [*eqn.invars, *eqn.outvars]], default=0)
            if not out and eqn.invars and name not in _KEPT and big >= min_elements:
                shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
                found.append(f"{name} of {shapes}")
        if out:
            traced.update(eqn.outvars)
