"""What a model conversion did, layer by layer: :class:`LayerPlan` (one layer) and
:class:`ConversionReport` (every layer a conversion saw, printed as a table), with
:func:`recipe_name`, the short name the table gives a recipe.

Example:
    >>> from jaxmx._src.core.recipes import MXFP8
    >>> plan = LayerPlan(path="up", kind="Dense", recipe=MXFP8, converted=True, reason="converted")
    >>> print(ConversionReport([plan]))
    up  Dense  MXFP8  converted
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from jaxmx._src.core.recipes import (
    DEEPSEEK_FP8,
    FP8_BLOCK_POW2,
    MXFP4,
    MXFP8,
    MXFP8_2D,
    MXFP8_HYBRID,
    NVFP4,
    Recipe,
)

_PRESETS = {
    "MXFP8": MXFP8,
    "MXFP8_HYBRID": MXFP8_HYBRID,
    "MXFP8_2D": MXFP8_2D,
    "DEEPSEEK_FP8": DEEPSEEK_FP8,
    "FP8_BLOCK_POW2": FP8_BLOCK_POW2,
    "NVFP4": NVFP4,
    "MXFP4": MXFP4,
}


def recipe_name(recipe: Recipe | None) -> str:
    """A short name for ``recipe``: its preset name, ``"high precision"`` for ``None``, else its
    forward and gradient formats.

    Example:
        >>> from jaxmx._src.core.recipes import NVFP4, Recipe
        >>> recipe_name(NVFP4), recipe_name(None), recipe_name(Recipe(grad="mxfp8_e5m2", rht=True))
        ('NVFP4', 'high precision', 'Recipe(mxfp8_e4m3 / mxfp8_e5m2, ...)')
    """
    if recipe is None:
        return "high precision"
    for name, preset in _PRESETS.items():
        if recipe == preset:
            return name
    return f"Recipe({recipe.fwd} / {recipe.grad}, ...)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerPlan:
    """What a conversion did to one layer.

    Example:
        >>> LayerPlan(path="blocks/0/up", kind="Dense", recipe=None, converted=False,
        ...           reason="excluded: exclude pattern 'blocks/*'").recipe is None
        True
    """

    path: str  # "/"-joined module path, relative to the converted model
    kind: str  # the layer's type name ("Dense", "LinearGeneral", "MultiHeadAttention", ...)
    recipe: Recipe | None  # the recipe its GEMMs run with; None: plain high precision
    converted: bool  # whether the conversion set its recipe (kept layers included)
    reason: str  # why: "converted", "kept: ...", "excluded: ...", "not matched by include", ...
    weights: str | None = None  # quantize_weights: how its weight is stored ("mxfp8_e4m3", ...)
    nbytes: int | None = None  # quantize_weights: the bytes of its stored weight (kernel)
    bf16_nbytes: int | None = None  # quantize_weights: the bytes of that weight in bfloat16
    layer: Any = dataclasses.field(default=None, compare=False, repr=False)  # nnx: the layer


class ConversionReport(Mapping):
    """``{path: LayerPlan}`` for every GEMM-bearing layer a conversion saw, in the order it saw
    them; ``str(report)`` is a table, ``report.converted`` the converted layers only. A report
    of ``quantize_weights`` also has each layer's stored weight bytes (a column of the table,
    :attr:`nbytes` in total, against :attr:`bf16_nbytes`).

    Example:
        >>> report = ConversionReport([
        ...     LayerPlan(path="up", kind="Dense", recipe=MXFP8, converted=True,
        ...               reason="converted"),
        ...     LayerPlan(path="head", kind="Dense", recipe=None, converted=False,
        ...               reason="excluded by default: 'head'")])
        >>> list(report.converted), report["head"].recipe
        (['up'], None)
        >>> print(report)
        up    Dense  MXFP8           converted
        head  Dense  high precision  excluded by default: 'head'
    """

    def __init__(self, plans: Iterable[LayerPlan]):
        self._plans = {p.path: p for p in plans}

    def __getitem__(self, path: str) -> LayerPlan:
        return self._plans[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._plans)

    def __len__(self) -> int:
        return len(self._plans)

    @property
    def converted(self) -> dict[str, LayerPlan]:
        """The layers whose recipe the conversion set (kept layers included)."""
        return {path: p for path, p in self._plans.items() if p.converted}

    @property
    def nbytes(self) -> int:
        """The bytes of the weights (kernels) the report sizes, as stored: ``quantize_weights``
        sizes every layer it lists with a kernel, converted or not (0 for other reports)."""
        return sum(p.nbytes for p in self._plans.values() if p.nbytes is not None)

    @property
    def bf16_nbytes(self) -> int:
        """The bytes of the same weights in bfloat16 (2 bytes per element)."""
        return sum(p.bf16_nbytes for p in self._plans.values() if p.nbytes is not None)

    def __str__(self) -> str:
        plans = list(self._plans.values())
        rows = [[p.path, p.kind, p.weights or recipe_name(p.recipe), p.reason] for p in plans]
        if any(p.nbytes is not None for p in plans):
            for row, p in zip(rows, plans, strict=True):
                row.insert(3, "" if p.nbytes is None else _sized(p.nbytes, p.bf16_nbytes))
            rows.append(["total", "", "", _sized(self.nbytes, self.bf16_nbytes), ""])
        n = len(rows[0]) - 1 if rows else 0
        widths = [max((len(r[i]) for r in rows), default=0) for i in range(n)]
        return "\n".join(
            "  ".join([*(c.ljust(w) for c, w in zip(r[:n], widths, strict=True)), r[n]]).rstrip()
            for r in rows
        )

    def __repr__(self) -> str:
        return f"ConversionReport({list(self._plans.values())!r})"


def _sized(nbytes: int, bf16_nbytes: int) -> str:
    ratio = f" ({nbytes / bf16_nbytes:.2f}x bf16)" if bf16_nbytes else ""
    return f"{nbytes:,} B{ratio}"
