"""The advisor's results for a training step: :class:`LayerAdvice` (one GEMM's legs and the
level it needs), :class:`Advice` (every GEMM of the step) and :func:`advised_recipes`, the
per-layer recipe mapping for ``quantize_model`` through :data:`LEVEL_RECIPES` (level -> Recipe).

Example:
    >>> layer = LayerAdvice(name="mlp/up", legs={}, level="1x128", reason="")
    >>> advised_recipes({"mlp/up": layer})["mlp/up"].fwd
    'fp8_e4m3_block'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

from jaxmx._src.core.recipes import (
    DEEPSEEK_FP8,
    FP8_ROWWISE,
    FP8_TENSORWISE,
    MXFP8,
    NVFP4,
    Recipe,
)
from jaxmx._src.diagnostics.granularity import Granularity
from jaxmx._src.diagnostics.levels import ladder
from jaxmx._src.diagnostics.tables import columns, pct
from jaxmx._src.diagnostics.telemetry import LEGS
from jaxmx._src.training.attention import PRODUCTS as ATTENTION_PRODUCTS

LEVEL_RECIPES: dict[str, Recipe] = {
    "tensor": FP8_TENSORWISE,
    "row": FP8_ROWWISE,
    "128x128": DEEPSEEK_FP8,  # activations and gradients 1x128, weights 128x128 tiles
    "1x128": DEEPSEEK_FP8.replace(weight_tile=None),  # every operand in 1x128 blocks
    "mx32": MXFP8,
    "nvfp4_16": NVFP4,
}
"""The recipe of each level, the default of :func:`advised_recipes` (a level missing from a
dict passed instead raises). ``FP8_TENSORWISE`` takes E5M2 gradients and ``FP8_ROWWISE``
power-of-two row scales, where the ``"tensor"`` / ``"row"`` levels measure ``fmt`` with float32
scales."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerAdvice:
    """One GEMM's advice: each leg's :class:`Granularity` and the level the GEMM needs.

    Attributes:
        name: the GEMM's name (the Flax layer's module path).
        legs: ``{leg: Granularity}`` for ``"lhs"``, ``"rhs"`` (the weight) and, when the step
            took a gradient through the GEMM, ``"dgrad"`` and ``"wgrad"``.
        level: the finest of the legs' recommended levels: the coarsest scaling every leg takes;
            ``None`` when a leg has no recommendation (it held NaN or inf, or overflows at
            every level: see ``nonfinite``).
        reason: which leg decides, and why.
        nonfinite: the legs without a recommendation, in :data:`LEGS` order.
    """

    name: str
    legs: dict[str, Granularity]
    level: str | None
    reason: str
    nonfinite: tuple[str, ...] = ()


class Advice(Mapping):
    """:func:`advise`'s result: ``{GEMM name: LayerAdvice}`` in call order; ``str()`` is a
    table (per leg, the level it takes and its underflow there) and :meth:`recipes` the
    per-layer recipe mapping for ``quantize_model``. :attr:`nonfinite` names the legs that held
    NaN or inf (or overflow at every level): their layers have no level, and :meth:`recipes`
    refuses them."""

    def __init__(self, layers: dict[str, LayerAdvice], *, underflow_budget: float, loss: float):
        self._layers, self.underflow_budget, self.loss = layers, underflow_budget, loss

    def __getitem__(self, name: str) -> LayerAdvice:
        return self._layers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    @property
    def nonfinite(self) -> dict[str, tuple[str, ...]]:
        """``{GEMM name: legs}`` of the legs without a recommendation (NaN or inf); empty when
        every leg was finite."""
        return {name: layer.nonfinite for name, layer in self._layers.items() if layer.nonfinite}

    def recipes(self, level_recipes: Mapping[str, Recipe] = LEVEL_RECIPES) -> dict[str, Recipe]:
        """:func:`advised_recipes` of this advice."""
        return advised_recipes(self, level_recipes)

    def table(self) -> str:
        """One row per GEMM: each leg's level (its underflow there) and the GEMM's level."""
        rows = [("layer", *LEGS, "needs")]
        for name, layer in self._layers.items():
            cells = []
            for leg in LEGS:
                g = layer.legs.get(leg)
                if g is None:
                    cells.append("-")
                    continue
                level = g.recommendation.level
                if level is None:
                    cells.append("NaN/inf")
                    continue
                cells.append(f"{level} ({pct(float(g.levels[level].underflow))})")
            rows.append((name, *cells, layer.level or "-"))
        return (
            f"underflow budget {pct(self.underflow_budget)}; per leg: the coarsest level "
            "within it (its underflow)\n" + columns(rows)
        )

    def __str__(self) -> str:
        return self.table()


def _layer_path(gemm_name: str) -> str:
    """The path of the layer a GEMM name belongs to: without its call count (``#k``), and an
    attention product's the attention layer's."""
    path = gemm_name.split("#")[0]
    parent, _, last = path.rpartition("/")
    return parent if parent and last in ATTENTION_PRODUCTS else path


def advised_recipes(
    advice: Mapping[str, LayerAdvice], level_recipes: Mapping[str, Recipe] = LEVEL_RECIPES
) -> dict[str, Recipe]:
    """``{layer path: Recipe}`` for ``quantize_model(..., recipe=...)``: each GEMM's advised
    level through ``level_recipes`` (a GEMM called more than once, ``name#1``, ..., takes the
    finest of its calls' levels, and an attention layer the finer of its two products,
    ``path/qk`` and ``path/pv``).

    Raises:
        ValueError: a layer's level has no recipe in ``level_recipes``, or a layer has no level
            (a leg held NaN or inf); the layers are named.

    Example:
        >>> layer = LayerAdvice(name="mlp/up", legs={}, level="mx32", reason="")
        >>> advised_recipes({"mlp/up": layer}) == {"mlp/up": MXFP8}
        True
    """
    unreadable = {name: layer.nonfinite for name, layer in advice.items() if layer.level is None}
    if unreadable:
        raise ValueError(
            f"advised_recipes: no level for GEMM(s) {unreadable} (GEMM: legs): they held NaN or "
            "inf (or overflow at every level), so their quantization cannot be read; find where "
            "with jaxmx.diagnostics.telemetry / first_nonfinite and advise again"
        )
    every, levels = ladder(), {}
    for name, layer in advice.items():
        path = _layer_path(name)
        if path not in levels or every.index(layer.level) > every.index(levels[path]):
            levels[path] = layer.level
    missing = {path: level for path, level in levels.items() if level not in level_recipes}
    if missing:
        raise ValueError(
            f"advised_recipes: no recipe for level(s) {sorted(set(missing.values()))} (layers "
            f"{sorted(missing)}); level_recipes has {sorted(level_recipes)}: add them"
        )
    return {path: level_recipes[level] for path, level in levels.items()}
