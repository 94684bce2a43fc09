"""What an optimizer state holds: each stored moment's format, shape and device bytes.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.optim.adam import adamw
    >>> state = adamw(1e-3).init({"w": jnp.ones((16, 512)), "b": jnp.zeros(512)})
    >>> [(r.moment, r.format, r.note != "") for r in state_report(state).rows if r.path == "['b']"]
    [('mu', 'float32', True), ('nu', 'float32', True)]
"""

from __future__ import annotations

import dataclasses

import jax

from jaxmx._src.optim import adam, moments


@dataclasses.dataclass(frozen=True, kw_only=True)
class MomentRow:
    """One stored moment: the parameter's path, ``"mu"`` or ``"nu"``, its format, the
    parameter's shape, its device bytes, and why a block format fell back to float32 (or ``""``)."""

    path: str
    moment: str
    format: str
    shape: tuple[int, ...]
    nbytes: int
    note: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateReport:
    """The moments of every low-precision Adam in a state, and the state's total device bytes."""

    rows: tuple[MomentRow, ...]
    total_bytes: int

    @property
    def fallbacks(self) -> tuple[MomentRow, ...]:
        """The moments kept in float32 in place of a block format."""
        return tuple(r for r in self.rows if r.note)

    def __str__(self) -> str:
        lines = [f"{'parameter':40s} {'moment':6s} {'format':8s} {'shape':16s} {'bytes':>10s}"]
        for r in self.rows:
            line = f"{r.path:40s} {r.moment:6s} {r.format:8s} {r.shape!s:16s} {r.nbytes:10d}"
            lines.append(line + (f"  ({r.note})" if r.note else ""))
        lines.append(f"total optimizer state: {self.total_bytes} bytes")
        return "\n".join(lines)


def state_bytes(tree) -> int:
    """Device bytes of a pytree's arrays (the sum of its leaves' ``nbytes``)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree) if hasattr(leaf, "nbytes"))


def state_report(state) -> StateReport:
    """The moments of every :class:`~jaxmx.optim.ScaleByAdamState` inside ``state`` (an optax
    state, under ``optax.chain``, ``optax.MultiSteps`` or ``nnx.Optimizer``'s ``opt_state``)."""
    rows = []

    def is_adam(x):
        return isinstance(x, adam.ScaleByAdamState)

    for _, node in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_adam)[0]:
        if not is_adam(node):
            continue
        for moment in ("mu", "nu"):
            for m in getattr(node, moment):
                shape = m.shape if isinstance(m, moments.BlockMoment) else m.values.shape
                note = m.note if isinstance(m, moments.DenseMoment) else ""
                rows.append(
                    MomentRow(
                        path=m.name,
                        moment=moment,
                        format=m.format,
                        shape=tuple(shape),
                        nbytes=moments.nbytes(m),
                        note=note,
                    )
                )
    return StateReport(rows=tuple(rows), total_bytes=state_bytes(state))
