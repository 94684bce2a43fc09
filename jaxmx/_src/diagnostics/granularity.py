"""The granularity advisor: which scaling granularity a tensor (or each GEMM leg of a training
step) needs, measured by quantizing it at every level of a ladder, coarsest first.

The ladder (:data:`LEVELS`, read from the format table by
:mod:`~jaxmx._src.diagnostics.levels`) and what each level quantizes with:

- ``"tensor"``: one float32 scale for the whole tensor (``fp8_*_tensor``: current scaling,
  torchao's tensorwise; 8-bit only);
- ``"row"``: one float32 scale per row along ``axis`` (``fp8_*_row``: torchao's axiswise; 8-bit
  only);
- ``"128x128"``: float32 scales per 128x128 tile of the last two axes (``fp8_*_block`` with
  ``tile=(128, 128)``; arrays of rank >= 2, leading axes as batch);
- ``"1x128"``: float32 scales per 128 elements along ``axis`` (``fp8_*_block``);
- ``"mx32"``: E8M0 scales per 32 elements (``mxfp8_*`` / ``mxfp4``, ``rceil``);
- ``"nvfp4_16"``: NVFP4's E4M3 scales per 16 elements and a tensor scale (4-bit only).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmx import diagnostics
    >>> x = jax.random.normal(jax.random.key(0), (8, 256))
    >>> rows = x * jnp.logspace(0, 7, 8)[:, None]  # rows 10^7 apart: one scale cannot hold them
    >>> diagnostics.granularity(x).recommendation.level
    'tensor'
    >>> diagnostics.granularity(rows, underflow_budget=0.01).recommendation.level
    'row'
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import jax
import numpy as np

from jaxmx._src.core.checks import normalize_axis
from jaxmx._src.core.dtypes import as_float_array
from jaxmx._src.core.explicit_axes import on_explicit_axes
from jaxmx._src.core.formats import Format
from jaxmx._src.diagnostics.level_stats import LevelStats, measure
from jaxmx._src.diagnostics.levels import checked_levels, element_of, levels_named, span_limit
from jaxmx._src.diagnostics.tables import columns, log2_text, pct


class Recommendation(NamedTuple):
    """The coarsest level that keeps underflow within the budget, and why (text). ``level`` is
    ``None`` when no level can be recommended: the tensor holds NaN or inf, or every level's
    dequantized values overflow (the reason says which)."""

    level: str | None
    reason: str


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Granularity:
    """:func:`granularity`'s result: :class:`LevelStats` for each measured level.

    A pytree (the statistics are its leaves), so it leaves a ``jax.jit``; read
    :attr:`recommendation`, :meth:`recommend` and :meth:`table` outside it.

    Attributes:
        stats: the :class:`LevelStats` of each of ``names`` (:attr:`levels` pairs them).
        names: the levels measured, in ladder order (coarsest first).
        element: the element format measured (``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"fp4_e2m1"``).
        span_limit: the element format's span, ``elem_max / 2^emin`` (28672 for E4M3).
        underflow_budget: the budget :attr:`recommendation` applies.
    """

    stats: tuple[LevelStats, ...]
    names: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))
    element: str = dataclasses.field(metadata=dict(static=True))
    span_limit: float = dataclasses.field(metadata=dict(static=True))
    underflow_budget: float = dataclasses.field(metadata=dict(static=True))

    @property
    def levels(self) -> dict[str, LevelStats]:
        """``{level: LevelStats}`` in ladder order."""
        return dict(zip(self.names, self.stats, strict=True))

    @property
    def recommendation(self) -> Recommendation:
        """:meth:`recommend` under :attr:`underflow_budget`."""
        return self.recommend(self.underflow_budget)

    @property
    def holds_nonfinite(self) -> bool:
        """Whether the tensor held NaN or inf (then every level's statistics are NaN but
        ``nonfinite`` and ``groups``, and no level is recommended)."""
        return any(math.isnan(s.underflow) for s in self._floats().values())

    def recommend(self, underflow_budget: float) -> Recommendation:
        """The coarsest measured level whose underflow fraction is at most ``underflow_budget``
        and whose dequantized values are all finite; if none underflows that little, the finest
        level, with the advice to spread the outliers (a Hadamard transform,
        ``Recipe(rht=True)``) or use finer blocks. The reason also reads the span rule: most
        groups below ``2^10``, per-tensor scaling may do; a tail above the span limit needs
        blocks; every group above it, finer blocks or a Hadamard transform.

        ``level`` is ``None`` when the tensor held NaN or inf, or when every level's dequantized
        values overflow: nothing can be recommended from a non-finite quantization.
        """
        underflow_budget = check_budget(underflow_budget)
        stats = self._floats()
        if self.holds_nonfinite:
            broken = ", ".join(f"{lv} {pct(s.nonfinite)}" for lv, s in stats.items())
            return Recommendation(
                None,
                f"x holds NaN or inf: no level can be recommended (elements dequantized to NaN "
                f"or inf: {broken})",
            )
        finite = {lv: s for lv, s in stats.items() if s.nonfinite == 0}
        if not finite:
            return Recommendation(
                None, "every level's dequantized values overflow float32 (inf): no level fits"
            )
        overflowing = [lv for lv in stats if lv not in finite]
        note = f" ({', '.join(overflowing)}: dequantized values overflow)" if overflowing else ""
        for level, s in finite.items():
            if s.underflow <= underflow_budget:
                return Recommendation(
                    level,
                    f"{level}: underflow {pct(s.underflow)} <= budget {pct(underflow_budget)}"
                    f"; {_span_reading(s, self.span_limit)}{note}",
                )
        level, s = list(finite.items())[-1]
        return Recommendation(
            level,
            f"no level keeps underflow within {pct(underflow_budget)}; the finest, {level}, "
            f"underflows {pct(s.underflow)} ({_span_reading(s, self.span_limit)}): apply a "
            f"Hadamard transform (Recipe(rht=True)) or finer blocks{note}",
        )

    def _floats(self) -> dict[str, LevelStats]:
        """:attr:`levels` as Python floats, or a ValueError for a batch of statistics."""
        shapes = {np.shape(v) for v in jax.tree.leaves(self.stats)}
        if shapes != {()}:
            raise ValueError(
                f"this Granularity holds statistics of shape {sorted(shapes)[-1]} (a batch, e.g. "
                "from jax.vmap), not scalars; read one tensor's: "
                "jax.tree.map(lambda a: a[i], g).recommendation"
            )
        return {level: jax.tree.map(float, s) for level, s in self.levels.items()}

    def table(self) -> str:
        """The statistics as a text table, one row per level, and the recommendation."""
        header = (
            "level",
            "groups",
            "underflow",
            "flushed",
            "saturated",
            "non-finite",
            "SQNR dB",
            "log2 span",
        )
        rows = [header]
        for level, s in self._floats().items():
            spans = "/".join(log2_text(v) for v in (s.span_p50, s.span_p99, s.span_max))
            rows.append(
                (
                    level,
                    str(int(s.groups)),
                    pct(s.underflow),
                    pct(s.flushed),
                    pct(s.saturated),
                    pct(s.nonfinite),
                    f"{s.sqnr_db:.1f}",
                    spans,
                )
            )
        rec = self.recommendation
        return "\n".join(
            [
                f"{self.element} (span limit 2^{math.log2(self.span_limit):.1f}); log2 span: "
                "p50/p99/max over groups",
                columns(rows),
                f"recommendation: {rec.level or 'none'} ({rec.reason})",
            ]
        )

    def __str__(self) -> str:
        return self.table()


def granularity(
    x: jax.Array,
    *,
    fmt: str | Format = "fp8_e4m3",
    axis: int = -1,
    levels: tuple[str, ...] | None = None,
    underflow_budget: float = 1e-3,
) -> Granularity:
    """Quantizes ``x`` at each scaling level and measures what each does (see the module
    docstring for the ladder and :class:`LevelStats` for the statistics). Jittable (no host
    callbacks). An ``x`` holding NaN or inf gives NaN statistics (``nonfinite`` says how much
    of each level's quantization it breaks) and no recommendation.

    Args:
        x: a float32, bfloat16 or float16 array of rank >= 1.
        fmt: the element format: ``"fp8_e4m3"`` (default), ``"fp8_e5m2"``, ``"fp4_e2m1"``, or a
            jaxmx format (name or :class:`jaxmx.Format`) of one of them.
        axis: the axis the rows and blocks run along (a GEMM's reduction axis).
        levels: the levels to measure, a subset of :data:`LEVELS`; ``None``: every level the
            format has (E4M3 / E5M2: all but ``"nvfp4_16"``; E2M1: ``"tensor"``, ``"row"``,
            ``"mx32"``, ``"nvfp4_16"``), without ``"128x128"`` for a 1-D ``x``.
        underflow_budget: the largest underflow fraction :attr:`Granularity.recommendation`
            accepts, in [0, 1].

    Raises:
        ValueError: an unknown format or level, a level the format has not, ``"128x128"`` for a
            1-D ``x``, an empty ``x``, a budget outside [0, 1].

    Example:
        >>> import jax
        >>> g = granularity(jax.random.normal(jax.random.key(0), (4, 128)), levels=("tensor",))
        >>> float(g.levels["tensor"].flushed), g.recommendation.level
        (0.0, 'tensor')
    """
    element = element_of(fmt)
    x = as_float_array(x, "granularity: x")
    if x.ndim == 0:
        raise ValueError("granularity expects an array of rank >= 1, got a scalar")
    if x.size == 0:
        raise ValueError(f"granularity: x of shape {x.shape} is empty: there is nothing to measure")
    levels = checked_levels(levels, element, x.ndim)
    check_budget(underflow_budget)
    axis = normalize_axis(axis, x.ndim)
    return Granularity(
        stats=on_explicit_axes(measure, x, axis=axis, levels=levels_named(element, levels)),
        names=levels,
        element=element,
        span_limit=span_limit(element),
        underflow_budget=float(underflow_budget),
    )


def check_budget(budget) -> float:
    """``budget`` as a float: a real number (numpy scalars included) in [0, 1]."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise ValueError(
            f"granularity: underflow_budget must be a number in [0, 1], got "
            f"{type(budget).__name__} {budget!r}"
        )
    if not 0 <= budget <= 1:
        raise ValueError(f"granularity: underflow_budget must be in [0, 1], got {budget!r}")
    return float(budget)


def _span_reading(s: LevelStats, limit: float) -> str:
    """The span rule's reading of one level's groups."""
    if s.span_above_limit >= 1:
        return "every group's span ratio is above the format's span"
    if s.span_above_limit > 0:
        return f"{pct(s.span_above_limit)} of groups above the format's span: needs blocks"
    if s.span_above_2_10 < 0.5:
        return f"span ratio p50 2^{log2_text(s.span_p50)} < 2^10: per-tensor scaling may do"
    return f"span ratio p50 2^{log2_text(s.span_p50)}, below the span 2^{math.log2(limit):.1f}"
