"""The granularity advisor's ladder of scaling levels, read from the format table.

A level is one entry of :data:`jaxmx.FORMATS` with a native GEMM family (the scalings a recipe
trains in) and the layout it quantizes in: a format with one scale per tensor or row is the
level ``"tensor"`` or ``"row"``; a block format is a level of its block (``"1x128"``: float32
scales, ``"mx32"``: E8M0 scales, ``"nvfp4_16"``: E4M3 scales under a tensor scale), and the
block-FP8 formats are also the level of their ``block x block`` weight tiles (``"128x128"``).
An element format (``"fp8_e4m3"``, ...) has the levels of the formats of its elements. The
ladder runs coarsest first (the most elements sharing one scale first); a format added to the
table is a level of its elements' ladder with no other edit.

Example:
    >>> ladder()
    ('tensor', 'row', '128x128', '1x128', 'mx32', 'nvfp4_16')
    >>> level = levels_of("fp8_e4m3")["128x128"]
    >>> level.format.name, level.tile
    ('fp8_e4m3_block', (128, 128))
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from jaxmx._src.core.formats import FORMATS, Format, get_format
from jaxmx._src.core.scale_kinds import (
    E4M3_SCALES_TENSOR_SCALED,
    E8M0_SCALES,
    FLOAT32_SCALES,
    ScaleKind,
)

# The name of a block level by its scale kind, ``{block}`` its elements per scale: the names the
# advisor's readers know (DeepSeek-V3's 1x128, MX's 32-blocks, NVFP4's 16-blocks). Naming is the
# one fact a format entry does not hold.
BLOCK_LEVEL_NAMES: dict[ScaleKind, str] = {
    FLOAT32_SCALES: "1x{block}",
    E8M0_SCALES: "mx{block}",
    E4M3_SCALES_TENSOR_SCALED: "nvfp4_{block}",
}

# The native GEMM families whose weights also come in ``block x block`` tiles (DeepSeek-V3's
# 128x128 weight scales; ``Recipe.weight_tile``): that level has no format entry of its own, it
# is the family's block format in a tiled layout.
TILED_FAMILIES = ("block_fp8",)

_SPAN_ORDER = {"tensor": 0, "row": 1, "block": 2}  # coarsest first


@dataclasses.dataclass(frozen=True, kw_only=True)
class Level:
    """One scaling level: the format it quantizes with and the layout.

    Attributes:
        name: the level's name (``"tensor"``, ``"row"``, ``"128x128"``, ``"1x128"``, ...).
        format: the :class:`jaxmx.Format` the level quantizes with.
        tile: ``(rows, cols)`` of a 2-D tile of the last two axes per scale, else ``None``.

    Example:
        >>> levels_of("fp4_e2m1")["nvfp4_16"].elements_per_scale
        16
    """

    name: str
    format: Format
    tile: tuple[int, int] | None = None

    @property
    def elements_per_scale(self) -> float:
        """Elements sharing one scale: ``inf`` per tensor or row (the ladder puts the tensor
        first), the tile's area, else the block."""
        if self.format.span != "block":
            return math.inf
        return math.prod(self.tile) if self.tile else self.format.block

    @property
    def order(self) -> tuple[int, float]:
        """The level's place on the ladder: coarsest first."""
        return (_SPAN_ORDER[self.format.span], -self.elements_per_scale)


def element_name(f: Format) -> str | None:
    """The element format name of ``f``'s elements (``"fp8_e4m3"`` for ``float8_e4m3fn``), or
    ``None`` for elements the advisor does not measure (integer or wider-word codes).

    Example:
        >>> element_name(get_format("nvfp4")), element_name(get_format("mxint8"))
        ('fp4_e2m1', None)
    """
    found = re.fullmatch(r"float(\d+)_(e\d+m\d+)\w*", np.dtype(f.elements).name)
    return None if f.code_bits is not None or found is None else f"fp{found[1]}_{found[2]}"


def _format_levels(f: Format) -> tuple[Level, ...]:
    """The levels of one format entry: none without a native GEMM family."""
    if f.gemm is None or element_name(f) is None:
        return ()
    if f.span != "block":
        return (Level(name=f.span, format=f),)
    pattern = BLOCK_LEVEL_NAMES.get(f.scale_kind)
    if pattern is None:
        raise ValueError(
            f"granularity: {f.name}'s scale kind {f.scale_kind.name!r} has no level name; add "
            "it to jaxmx._src.diagnostics.levels.BLOCK_LEVEL_NAMES"
        )
    block = (Level(name=pattern.format(block=f.block), format=f),)
    if f.gemm not in TILED_FAMILIES:
        return block
    return (Level(name=f"{f.block}x{f.block}", format=f, tile=(f.block, f.block)), *block)


def _table_levels() -> dict[str, dict[str, Level]]:
    """``{element: {level name: Level}}`` of the format table as it is now, ladder order."""
    found: dict[str, dict[str, Level]] = {}
    for f in FORMATS.values():
        for level in _format_levels(f):
            own = found.setdefault(element_name(f), {})
            if level.name in own:
                raise ValueError(
                    f"granularity: {own[level.name].format.name} and {f.name} both scale "
                    f"{element_name(f)} as level {level.name!r}; one format per level"
                )
            own[level.name] = level
    return {
        element: dict(sorted(own.items(), key=lambda item: item[1].order))
        for element, own in found.items()
    }


def elements() -> tuple[str, ...]:
    """The element formats the advisor measures, in table order.

    Example:
        >>> elements()
        ('fp8_e4m3', 'fp8_e5m2', 'fp4_e2m1')
    """
    return tuple(_table_levels())


def levels_of(element: str) -> dict[str, Level]:
    """``{level name: Level}`` of ``element``, coarsest first (a KeyError for another name)."""
    return _table_levels()[element]


def levels_named(element: str, names: tuple[str, ...]) -> tuple[Level, ...]:
    """The :class:`Level` of each of ``names`` for ``element`` (names checked by
    :func:`checked_levels`).

    Example:
        >>> [level.format.name for level in levels_named("fp8_e5m2", ("row", "mx32"))]
        ['fp8_e5m2_row', 'mxfp8_e5m2']
    """
    own = levels_of(element)
    return tuple(own[name] for name in names)


def ladder() -> tuple[str, ...]:
    """Every level's name, coarsest first (a level of several elements counted once).

    Example:
        >>> ladder()[:2]
        ('tensor', 'row')
    """
    every = {}
    for own in _table_levels().values():
        for level in own.values():
            every.setdefault(level.name, level)
    return tuple(sorted(every, key=lambda name: every[name].order))


LEVELS = ladder()
"""The scaling granularities, coarsest first (the elements sharing one scale: the whole tensor,
a row, a 128x128 tile, 128, 32, 16)."""

ELEMENTS = elements()
"""The element formats :func:`jaxmx.diagnostics.granularity` measures (or any jaxmx format name
of one)."""


def element_of(fmt: str | Format) -> str:
    """The element format name of ``fmt`` (:func:`elements`, or a jaxmx format of one).

    Example:
        >>> element_of("mxfp8_e5m2")
        'fp8_e5m2'
    """
    known = elements()
    if isinstance(fmt, str) and fmt in known:
        return fmt
    try:
        f = get_format(fmt)
    except ValueError:
        raise ValueError(
            f"granularity: unknown fmt {fmt!r}; expected an element format {known} or a jaxmx "
            "format of one (mxfp8_e4m3, fp8_e4m3_block, nvfp4, ...)"
        ) from None
    if element_name(f) not in known:
        raise ValueError(
            f"granularity: {f.name}'s elements are none of the element formats measured "
            f"{known} (no native GEMM takes them)"
        )
    return element_name(f)


def element_format(element: str) -> Format:
    """A format of ``element``'s (the first in the table): its element facts (``elem_max``,
    ``emin``, ...)."""
    return next(iter(levels_of(element).values())).format


def span_limit(element: str) -> float:
    """The element format's span, ``elem_max / 2^emin`` (28672 for E4M3).

    Example:
        >>> span_limit("fp8_e4m3")
        28672.0
    """
    f = element_format(element)
    return f.elem_max / 2.0**f.emin


def available_levels(element: str, ndim: int = 2) -> tuple[str, ...]:
    """The levels :func:`jaxmx.diagnostics.granularity` measures by default for ``element``
    and rank ``ndim`` (tiled levels need rank >= 2).

    Example:
        >>> available_levels("fp8_e4m3", 1)
        ('tensor', 'row', '1x128', 'mx32')
    """
    return tuple(
        name for name, level in levels_of(element).items() if level.tile is None or ndim >= 2
    )


def checked_levels(levels, element: str, ndim: int) -> tuple[str, ...]:
    """``levels`` (a name, names, or ``None``: every level ``element`` has at rank ``ndim``) in
    ladder order, or a ValueError naming an unknown level, one ``element`` has not, or a tiled
    level of a 1-D array.

    Example:
        >>> checked_levels(("mx32", "tensor"), "fp8_e4m3", 2)
        ('tensor', 'mx32')
    """
    if levels is None:
        return available_levels(element, ndim)
    every = ladder()
    levels = (levels,) if isinstance(levels, str) else tuple(levels)
    unknown = [lv for lv in levels if lv not in every]
    if unknown or not levels:
        raise ValueError(f"granularity: unknown level(s) {unknown}; expected some of {every}")
    have = available_levels(element, 2)
    missing = [lv for lv in levels if lv not in have]
    if missing:
        raise ValueError(f"granularity: {element} has no level {missing}; its levels are {have}")
    tiled = [lv for lv in levels if levels_of(element)[lv].tile is not None]
    if tiled and ndim < 2:
        raise ValueError(
            f"granularity: level {tiled[0]!r} tiles the last two axes, so x needs rank >= 2, got "
            "a 1-D array"
        )
    return tuple(lv for lv in every if lv in levels)  # ladder order
