"""The granularity advisor: which scaling granularity a tensor (or each GEMM leg of a training
step) needs, measured by quantizing it at every level of a ladder, coarsest first.

The ladder (:data:`LEVELS`) and what each level quantizes with:

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
import functools
import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from jaxmx._src.core import bits
from jaxmx._src.core.checks import normalize_axis
from jaxmx._src.core.dtypes import as_float_array
from jaxmx._src.core.explicit_axes import on_context_mesh, on_explicit_axes
from jaxmx._src.core.formats import Format, get_format
from jaxmx._src.core.recipes import (
    DEEPSEEK_FP8,
    FP8_ROWWISE,
    FP8_TENSORWISE,
    MXFP8,
    NVFP4,
    Recipe,
)
from jaxmx._src.diagnostics.telemetry import LEGS
from jaxmx._src.quantize.codec import decode_elements
from jaxmx._src.quantize.quantize import dequantize, quantize
from jaxmx._src.training.attention import PRODUCTS as ATTENTION_PRODUCTS
from jaxmx._src.training.scope import Leg, Tap, observing

LEVELS = ("tensor", "row", "128x128", "1x128", "mx32", "nvfp4_16")
"""The scaling granularities, coarsest first (the elements sharing one scale: the whole tensor,
a row, a 128x128 tile, 128, 32, 16)."""

ELEMENTS = ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
"""The element formats :func:`granularity` measures (or any jaxmx format name of one)."""

# element format -> {level: (jaxmx format, tile)}: the quantizer of each level it has
_QUANTIZERS = {
    "fp8_e4m3": {
        "tensor": ("fp8_e4m3_tensor", None),
        "row": ("fp8_e4m3_row", None),
        "128x128": ("fp8_e4m3_block", (128, 128)),
        "1x128": ("fp8_e4m3_block", None),
        "mx32": ("mxfp8_e4m3", None),
    },
    "fp8_e5m2": {
        "tensor": ("fp8_e5m2_tensor", None),
        "row": ("fp8_e5m2_row", None),
        "128x128": ("fp8_e5m2_block", (128, 128)),
        "1x128": ("fp8_e5m2_block", None),
        "mx32": ("mxfp8_e5m2", None),
    },
    "fp4_e2m1": {"mx32": ("mxfp4", None), "nvfp4_16": ("nvfp4", None)},
}
_TWIN = {"fp8_e4m3": "mxfp8_e4m3", "fp8_e5m2": "mxfp8_e5m2", "fp4_e2m1": "mxfp4"}
_ELEMENT_OF_DTYPE = {
    np.dtype(jnp.float8_e4m3fn): "fp8_e4m3",
    np.dtype(jnp.float8_e5m2): "fp8_e5m2",
    np.dtype(jnp.float4_e2m1fn): "fp4_e2m1",
}
_GROUP = {"1x128": 128, "mx32": 32, "nvfp4_16": 16}  # elements per block along the axis
_TILE = 128

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


class LevelStats(NamedTuple):
    """What one scaling level does to a tensor (float32 scalars).

    Attributes:
        underflow: the fraction of non-zero elements whose quantized code is below the element
            format's smallest normal (a subnormal, or zero): they keep fewer mantissa bits.
        flushed: the fraction of non-zero elements whose code is zero.
        saturated: the fraction of non-zero elements clipped at the format's largest value
            (beyond its rounding interval), or whose dequantized value overflows float32 (inf).
        sqnr_db: ``10 log10(sum x^2 / sum (x - dequantized)^2)`` over the tensor (``inf``:
            exact; ``-inf``: a finite element dequantizes to inf).
        span_p50, span_p90, span_p99, span_max: quantiles of the groups' span ratio
            ``amax_g / std_g`` (population std; as :class:`jaxmx.diagnostics.BlockStats`), one
            group per scale of the level; ``span_pq`` is the smallest span with at least q% of
            the groups at or below it.
        span_above_2_10, span_above_limit: the fraction of groups whose span ratio exceeds
            ``2^10`` and the format's span (``elem_max`` over its smallest normal).
        groups: the number of groups (scales).
        nonfinite: the fraction of elements whose dequantized value is NaN or inf (an input NaN
            or inf, every element of a group whose scale it makes NaN, an overflow).

    A tensor holding NaN or inf has NaN for every statistic but ``nonfinite`` and ``groups``:
    its quantization cannot be read (per tensor, every element dequantizes to NaN).
    Statistics are computed from the float32 bits or on values scaled by a power of two, so
    subnormal inputs count as non-zero and magnitudes up to float32's largest do not overflow.
    """

    underflow: jax.Array
    flushed: jax.Array
    saturated: jax.Array
    sqnr_db: jax.Array
    span_p50: jax.Array
    span_p90: jax.Array
    span_p99: jax.Array
    span_max: jax.Array
    span_above_2_10: jax.Array
    span_above_limit: jax.Array
    groups: jax.Array
    nonfinite: jax.Array


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
        underflow_budget = _check_budget(underflow_budget)
        stats = self._floats()
        if self.holds_nonfinite:
            broken = ", ".join(f"{lv} {_pct(s.nonfinite)}" for lv, s in stats.items())
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
                    f"{level}: underflow {_pct(s.underflow)} <= budget {_pct(underflow_budget)}"
                    f"; {_span_reading(s, self.span_limit)}{note}",
                )
        level, s = list(finite.items())[-1]
        return Recommendation(
            level,
            f"no level keeps underflow within {_pct(underflow_budget)}; the finest, {level}, "
            f"underflows {_pct(s.underflow)} ({_span_reading(s, self.span_limit)}): apply a "
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
            spans = "/".join(_log2(v) for v in (s.span_p50, s.span_p99, s.span_max))
            rows.append(
                (
                    level,
                    str(int(s.groups)),
                    _pct(s.underflow),
                    _pct(s.flushed),
                    _pct(s.saturated),
                    _pct(s.nonfinite),
                    f"{s.sqnr_db:.1f}",
                    spans,
                )
            )
        rec = self.recommendation
        return "\n".join(
            [
                f"{self.element} (span limit 2^{math.log2(self.span_limit):.1f}); log2 span: "
                "p50/p99/max over groups",
                _columns(rows),
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
    levels = _checked_levels(levels, element, x.ndim)
    _check_budget(underflow_budget)
    axis = normalize_axis(axis, x.ndim)
    return Granularity(
        stats=on_explicit_axes(_measure, x, element=element, axis=axis, levels=levels),
        names=levels,
        element=element,
        span_limit=_span_limit(element),
        underflow_budget=float(underflow_budget),
    )


def element_of(fmt: str | Format) -> str:
    """The element format name of ``fmt`` (:data:`ELEMENTS`, or a jaxmx format of one)."""
    if isinstance(fmt, str) and fmt in ELEMENTS:
        return fmt
    try:
        f = get_format(fmt)
    except ValueError:
        raise ValueError(
            f"granularity: unknown fmt {fmt!r}; expected an element format {ELEMENTS} or a jaxmx "
            "format of one (mxfp8_e4m3, fp8_e4m3_block, nvfp4, ...)"
        ) from None
    return _ELEMENT_OF_DTYPE[np.dtype(f.dtype)]


def available_levels(element: str, ndim: int = 2) -> tuple[str, ...]:
    """The levels :func:`granularity` measures by default for ``element`` and rank ``ndim``."""
    have = _QUANTIZERS[element]
    return tuple(lv for lv in LEVELS if lv in have and (lv != "128x128" or ndim >= 2))


def _checked_levels(levels, element: str, ndim: int) -> tuple[str, ...]:
    if levels is None:
        return available_levels(element, ndim)
    levels = (levels,) if isinstance(levels, str) else tuple(levels)
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown or not levels:
        raise ValueError(f"granularity: unknown level(s) {unknown}; expected some of {LEVELS}")
    missing = [lv for lv in levels if lv not in available_levels(element, 2)]
    if missing:
        raise ValueError(
            f"granularity: {element} has no level {missing}; its levels are "
            f"{available_levels(element, 2)}"
        )
    if "128x128" in levels and ndim < 2:
        raise ValueError(
            "granularity: level '128x128' tiles the last two axes, so x needs rank >= 2, got a "
            "1-D array"
        )
    return tuple(lv for lv in LEVELS if lv in levels)  # ladder order


def _check_budget(budget) -> float:
    """``budget`` as a float: a real number (numpy scalars included) in [0, 1]."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise ValueError(
            f"granularity: underflow_budget must be a number in [0, 1], got "
            f"{type(budget).__name__} {budget!r}"
        )
    if not 0 <= budget <= 1:
        raise ValueError(f"granularity: underflow_budget must be in [0, 1], got {budget!r}")
    return float(budget)


def _span_limit(element: str) -> float:
    f = get_format(_TWIN[element])
    return f.elem_max / 2.0**f.emin


@functools.partial(jax.jit, static_argnames=("element", "axis", "levels"))
def _measure(x, *, element: str, axis: int, levels: tuple[str, ...]) -> tuple[LevelStats, ...]:
    """The :class:`LevelStats` of each level, ``x``'s ``axis`` moved last."""
    x = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    f = get_format(_TWIN[element])
    out = []
    for level in levels:
        name, tile = _QUANTIZERS[element][level]
        q = quantize(x, name, tile=tile)
        codes = decode_elements(q.data, get_format(name))[tuple(slice(0, n) for n in x.shape)]
        xhat = dequantize(q, jnp.float32)
        values, valid = _groups(x, level)
        out.append(_level_stats(x, codes, xhat, _spans(values, valid), f))
    return tuple(out)


def _groups(x: jax.Array, level: str) -> tuple[jax.Array, jax.Array]:
    """``x`` as ``[groups, size]`` (one group per scale of ``level``) and the mask of its real
    elements (zero padding of partial blocks and tiles is not)."""
    if level == "tensor":
        return x.reshape(1, -1), _all_true((1, x.size))
    if level == "row":
        return x.reshape(-1, x.shape[-1]), _all_true((x.size // x.shape[-1], x.shape[-1]))
    valid = _all_true(x.shape)
    if level == "128x128":
        pad = [(0, 0)] * (x.ndim - 2) + [(0, -n % _TILE) for n in x.shape[-2:]]
        x, valid = jnp.pad(x, pad), jnp.pad(valid, pad)

        def tiles(a):
            a = a.reshape(-1, a.shape[-2] // _TILE, _TILE, a.shape[-1] // _TILE, _TILE)
            return a.transpose(0, 1, 3, 2, 4).reshape(-1, _TILE * _TILE)

        return tiles(x), tiles(valid)
    block = _GROUP[level]
    pad = [(0, 0)] * (x.ndim - 1) + [(0, -x.shape[-1] % block)]
    x, valid = jnp.pad(x, pad), jnp.pad(valid, pad)
    return x.reshape(-1, block), valid.reshape(-1, block)


def _all_true(shape: tuple[int, ...]) -> jax.Array:
    """A boolean mask of ``shape``, all true, that XLA cannot evaluate while compiling (a
    constant mask would be padded, reshaped and summed element by element at compile time)."""
    return jax.lax.optimization_barrier(jnp.ones(shape, bool))


def _bits_nonzero(b: jax.Array) -> jax.Array:
    """``b != 0`` for the bits of non-negative float32 values, subnormals included (compared
    field by field, as :func:`~jaxmx._src.diagnostics.block_stats._bits_less` does)."""
    return ((b >> bits.MANTISSA_BITS) != 0) | ((b & bits.MANTISSA_MASK) != 0)


def _magnitude_bits(x: jax.Array) -> jax.Array:
    """The float32 bits of ``|x|`` (ordered as the magnitudes, subnormals included)."""
    return bits.to_bits(x) & 0x7FFFFFFF


def _down_to_one(x: jax.Array, amax_bits: jax.Array) -> jax.Array:
    """``x / 2^k`` exactly, with ``2^k`` the binade of the magnitude whose bits are
    ``amax_bits`` (broadcast against ``x``), so the largest value is in [1, 2): ratios of sums
    of squares are then free of float32 overflow (``|x|`` above about 1.8e19) and of subnormal
    flushing (XLA:CPU flushes subnormals in arithmetic)."""
    exponent = bits.exponent_and_mantissa(amax_bits)[0] - bits.EXPONENT_BIAS
    return bits.scale_by_pow2(x, -jnp.clip(exponent, -127, 127))


def _spans(values: jax.Array, valid: jax.Array) -> jax.Array:
    """Each group's ``amax / std`` (population std of its real elements): ``inf`` where the std
    is 0 and ``amax > 0``, 0 for an all-zero group; computed on the group scaled to its amax's
    binade (no overflow, no flushed subnormals)."""
    count = jnp.sum(valid, axis=1)
    amax_bits = jnp.max(jnp.where(valid, _magnitude_bits(values), 0), axis=1)
    values = _down_to_one(values, amax_bits[:, None])
    amax = jnp.max(jnp.where(valid, jnp.abs(values), 0.0), axis=1)
    mean = jnp.sum(jnp.where(valid, values, 0.0), axis=1) / count
    var = jnp.sum(jnp.where(valid, (values - mean[:, None]) ** 2, 0.0), axis=1) / count
    std = jnp.sqrt(var)
    all_zero = ~_bits_nonzero(amax_bits)
    return jnp.where(all_zero, 0.0, jnp.where(std == 0, jnp.inf, amax / std))


def _level_stats(x, codes, xhat, spans, f: Format) -> LevelStats:
    magnitude = _magnitude_bits(x)
    nonzero = _bits_nonzero(magnitude)  # subnormals are not zero
    n = jnp.maximum(jnp.sum(nonzero), 1)
    finite_in = (magnitude >> bits.MANTISSA_BITS) != 0xFF
    holds_nonfinite = ~jnp.all(finite_in)
    overflow = nonzero & finite_in & ~jnp.isfinite(xhat)  # a finite element dequantized to inf

    def fraction(condition):
        share = (jnp.sum(nonzero & condition) / n).astype(jnp.float32)
        return jnp.where(holds_nonfinite, jnp.nan, share)

    # x and xhat in units of the tensor's binade: no overflow, no flushed subnormals
    amax_bits = jnp.max(jnp.where(finite_in, magnitude, 0))
    x1, xhat1 = _down_to_one(x, amax_bits), _down_to_one(xhat, amax_bits)
    half_ulp = 2.0 ** (f.emax - f.mbits - 1)  # at elem_max: beyond it, rounding would go higher
    clipped = (jnp.abs(codes) == f.elem_max) & (
        jnp.abs(x1) * f.elem_max > jnp.abs(xhat1) * (f.elem_max + half_ulp)
    )
    noise = jnp.sum(jnp.where(overflow, jnp.inf, (x1 - xhat1) ** 2))
    sqnr = jnp.where(noise == 0, jnp.inf, 10 * jnp.log10(jnp.sum(x1**2) / noise))

    spans = jnp.where(holds_nonfinite, jnp.nan, spans)
    ordered = jnp.sort(spans)

    def quantile(q):  # the smallest span with at least q% of the groups at or below it
        return ordered[max(math.ceil(q / 100 * spans.size) - 1, 0)].astype(jnp.float32)

    def share_of_groups(condition):
        return jnp.where(holds_nonfinite, jnp.nan, jnp.mean(condition)).astype(jnp.float32)

    return LevelStats(
        underflow=fraction(jnp.abs(codes) < 2.0**f.emin),
        flushed=fraction(codes == 0),
        saturated=fraction(clipped | overflow),
        sqnr_db=jnp.where(holds_nonfinite, jnp.nan, sqnr).astype(jnp.float32),
        span_p50=quantile(50),
        span_p90=quantile(90),
        span_p99=quantile(99),
        span_max=jnp.max(spans).astype(jnp.float32),
        span_above_2_10=share_of_groups(spans > 2.0**10),
        span_above_limit=share_of_groups(spans > f.elem_max / 2.0**f.emin),
        groups=jnp.float32(spans.size),
        nonfinite=jnp.mean(~jnp.isfinite(xhat)).astype(jnp.float32),
    )


def _pct(v: float) -> str:
    return f"{100 * v:.3g}%"


def _log2(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if v == 0:
        return "-inf"
    return "inf" if math.isinf(v) else f"{math.log2(v):.1f}"


def _span_reading(s: LevelStats, limit: float) -> str:
    """The span rule's reading of one level's groups."""
    if s.span_above_limit >= 1:
        return "every group's span ratio is above the format's span"
    if s.span_above_limit > 0:
        return f"{_pct(s.span_above_limit)} of groups above the format's span: needs blocks"
    if s.span_above_2_10 < 0.5:
        return f"span ratio p50 2^{_log2(s.span_p50)} < 2^10: per-tensor scaling may do"
    return f"span ratio p50 2^{_log2(s.span_p50)}, below the span 2^{math.log2(limit):.1f}"


def _columns(rows) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


# --- in training: every GEMM leg of one step ------------------------------------------------


def _leg_levels(levels: tuple[str, ...], leg: str) -> tuple[str, ...]:
    """The levels measured on a leg: ``"128x128"`` tiles for the weight (``rhs``) only."""
    return levels if leg == "rhs" else tuple(lv for lv in levels if lv != "128x128")


def _leg_tensor(leg: Leg) -> jax.Array:
    """The tensor a leg quantizes, float32, out of the gradient."""
    return jax.lax.stop_gradient(leg.x).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _GradientLegs:
    """A GEMM's backward hook (hashable): the output gradient's two copies, as tensors; with
    ``sizes``, instead records their shapes and axes there under ``name`` and returns the
    scalar tap's zero cotangent (the abstract pass that sizes the taps)."""

    sizes: dict | None = dataclasses.field(default=None, hash=False, compare=False)
    name: str = ""

    def __call__(self, dgrad: Leg, wgrad: Leg):
        legs = {"dgrad": dgrad, "wgrad": wgrad}
        if self.sizes is None:
            return {leg: _leg_tensor(g) for leg, g in legs.items()}
        self.sizes[self.name] = {leg: (g.x.shape, g.axis) for leg, g in legs.items()}
        return jnp.zeros((), jnp.float32)


class _Advisor:
    """The observer of :func:`advise`: each GEMM's forward legs kept as tensors (and their
    axes), its backward legs through its tap (see :mod:`jaxmx._src.training.scope`): with
    ``sizes``, a scalar tap per GEMM whose backward records the legs' shapes there; else each
    GEMM of ``taps`` gets its tap, zeros shaped like its backward legs."""

    def __init__(self, taps: dict | None, sizes: dict | None = None):
        self.taps, self.sizes = taps, sizes
        self.forward: dict[str, dict[str, jax.Array]] = {}
        self.axes: dict[str, dict[str, int]] = {}
        self._trace = jax.extend.core.get_opaque_trace_state()

    def forward_legs(self, name: str, recipe: Recipe, lhs: Leg, rhs: Leg) -> Tap | None:
        if jax.extend.core.get_opaque_trace_state() != self._trace:
            raise ValueError(
                "jaxmx.diagnostics.advise: a GEMM ran inside a transformation (jax.checkpoint, "
                "scan, vmap, jit, ...) nested in the step, whose values cannot leave it; call "
                "advise on a step without it"
            )
        name = next(
            c
            for c in [name] + [f"{name}#{i}" for i in range(1, len(self.forward) + 2)]
            if c not in self.forward
        )
        self.forward[name] = {"lhs": _leg_tensor(lhs), "rhs": _leg_tensor(rhs)}
        self.axes[name] = {"lhs": lhs.axis, "rhs": rhs.axis}
        if self.taps is None or name not in self.taps:
            return None
        if self.sizes is not None:
            return Tap(self.taps[name], _GradientLegs(self.sizes, name))
        return Tap(self.taps[name], _GradientLegs())


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
                cells.append(f"{level} ({_pct(float(g.levels[level].underflow))})")
            rows.append((name, *cells, layer.level or "-"))
        return (
            f"underflow budget {_pct(self.underflow_budget)}; per leg: the coarsest level "
            "within it (its underflow)\n" + _columns(rows)
        )

    def __str__(self) -> str:
        return self.table()


def advise(
    fn: Callable,
    *args,
    fmt: str | Format = "fp8_e4m3",
    levels: tuple[str, ...] | None = None,
    underflow_budget: float = 1e-3,
    **kwargs,
) -> Advice:
    """Measures every GEMM leg of one training step at every scaling level: the forward
    operands (``lhs`` along K, ``rhs`` the weight along K) and the output gradient's copies
    (``dgrad`` along N, ``wgrad`` along M), as :func:`granularity` does for one tensor.

    ``fn(*args, **kwargs)`` computes a scalar loss with jaxmx GEMMs (:func:`jaxmx.dot_general`
    and what is built on it: the layers of a model converted by ``quantize_model`` are named by
    module path, other GEMMs by :func:`jaxmx.diagnostics.named`). It is traced abstractly twice
    (to find the GEMMs, then the shapes of their gradient legs) and run once under ``jax.jit``
    with the gradient taken, keeping every leg; each leg is then measured by
    :func:`granularity`'s compiled program, one per leg shape (no host callbacks). The GEMMs
    run in their own recipes;
    the legs are measured in ``fmt`` whatever those are.

    Args:
        fn: the loss function of ``args`` and ``kwargs`` (arrays, Flax nnx modules, any pytree):
            their array leaves enter the step's ``jax.jit`` as arguments (arrays ``fn`` closes
            over itself become constants of the program, which XLA folds while compiling:
            pass them in ``args``), the other leaves as they are.
        fmt: the element format measured (as for :func:`granularity`).
        levels: the levels measured (as for :func:`granularity`; ``None``: all the format has).
            ``"128x128"`` is measured on the weight (``rhs``) only: activations and gradients
            are not tiled.
        underflow_budget: the largest underflow fraction a level may leave, in [0, 1].

    Returns:
        an :class:`Advice` (its ``loss``: the step's loss).

    Example:
        >>> import jax, jax.numpy as jnp, jaxmx
        >>> from jaxmx import diagnostics
        >>> def loss(w, x):
        ...     with diagnostics.named("proj"):
        ...         return (jaxmx.dot_general(x, w, (((1,), (0,)), ((), ()))) ** 2).sum()
        >>> x, w = jax.random.normal(jax.random.key(0), (2, 32, 64))
        >>> advice = diagnostics.advise(loss, w.T, x, underflow_budget=0.01)
        >>> advice["proj"].level, sorted(advice["proj"].legs)
        ('tensor', ['dgrad', 'lhs', 'rhs', 'wgrad'])
    """
    element = element_of(fmt)
    levels = _checked_levels(levels, element, 2)
    if levels == ("128x128",):
        raise ValueError(
            "jaxmx.diagnostics.advise: levels=('128x128',) measures the weights only; add a level "
            "for the activations and gradients"
        )
    _check_budget(underflow_budget)
    observers: list[_Advisor] = []
    arrays, rebuild = _array_arguments((args, kwargs))

    def run(taps, arrays, sizes=None):
        observers.append(_Advisor(taps, sizes))
        step_args, step_kwargs = rebuild(arrays)
        with observing(observers[-1]):
            loss = fn(*step_args, **step_kwargs)
        return loss, observers[-1].forward

    jax.eval_shape(lambda arrays: run(None, arrays), arrays)
    names = list(observers[0].forward)
    if not names:
        raise ValueError("jaxmx.diagnostics.advise: the step ran no jaxmx GEMM; nothing to advise")
    sizes: dict[str, dict] = {}
    scalars = {name: jnp.zeros((), jnp.float32) for name in names}
    jax.eval_shape(jax.grad(lambda taps: run(taps, arrays, sizes)[0]), scalars)
    taps = {
        name: {leg: jnp.zeros(shape, jnp.float32) for leg, (shape, _) in legs.items()}
        for name, legs in sizes.items()
    }
    (loss, forward), grads = jax.jit(jax.value_and_grad(run, has_aux=True))(taps, arrays)
    # a GEMM on Explicit mesh axes runs with them switched to Auto: its forward legs come out so
    forward = on_context_mesh(forward)
    sized = observers[1]
    axes = {
        name: {
            **sized.axes[name],
            **{leg: axis for leg, (_, axis) in sizes.get(name, {}).items()},
        }
        for name in names
    }
    measured = {
        name: {
            leg: _leg_stats(x, axes[name][leg], element, levels, leg)
            for leg, x in {**forward[name], **grads.get(name, {})}.items()
        }
        for name in names
    }
    return Advice(
        {
            name: _layer_advice(name, measured[name], element, levels, underflow_budget)
            for name in names
        },
        underflow_budget=float(underflow_budget),
        loss=float(loss),
    )


def _leg_stats(x: jax.Array, axis: int, element: str, levels, leg: str):
    """A leg's :class:`LevelStats`: one compiled program per shape, axis and levels, shared by
    every leg that has them (the layers of a model repeat a few shapes)."""
    axis = normalize_axis(axis, x.ndim)
    levels = _leg_levels(levels, leg)
    return jax.device_get(on_explicit_axes(_measure, x, element=element, axis=axis, levels=levels))


def _array_arguments(tree) -> tuple[list, Callable]:
    """The array leaves of ``tree`` (JAX and numpy arrays: the weights and data of a step) and
    the function that puts leaves in their place. The step takes them as arguments of its
    ``jax.jit``: closed over, they would be constants of the program, which XLA evaluates
    while compiling (slowly, element by element)."""
    leaves, treedef = jax.tree.flatten(tree)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array | np.ndarray)]

    def rebuild(arrays):
        filled = list(leaves)
        for i, a in zip(where, arrays, strict=True):
            filled[i] = a
        return jax.tree.unflatten(treedef, filled)

    return [leaves[i] for i in where], rebuild


def _layer_advice(name, measured, element, levels, budget) -> LayerAdvice:
    legs = {
        leg: Granularity(
            stats=tuple(measured[leg]),
            names=_leg_levels(levels, leg),
            element=element,
            span_limit=_span_limit(element),
            underflow_budget=float(budget),
        )
        for leg in LEGS
        if leg in measured
    }
    decided = {leg: g.recommendation for leg, g in legs.items()}
    nonfinite = tuple(leg for leg, rec in decided.items() if rec.level is None)
    if nonfinite:
        reasons = "; ".join(f"{leg}: {decided[leg].reason}" for leg in nonfinite)
        return LayerAdvice(name=name, legs=legs, level=None, reason=reasons, nonfinite=nonfinite)
    leg = max(decided, key=lambda leg: LEVELS.index(decided[leg].level))
    return LayerAdvice(
        name=name, legs=legs, level=decided[leg].level, reason=f"{leg}: {decided[leg].reason}"
    )


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
    levels: dict[str, str] = {}
    for name, layer in advice.items():
        path = _layer_path(name)
        if path not in levels or LEVELS.index(layer.level) > LEVELS.index(levels[path]):
            levels[path] = layer.level
    missing = {path: level for path, level in levels.items() if level not in level_recipes}
    if missing:
        raise ValueError(
            f"advised_recipes: no recipe for level(s) {sorted(set(missing.values()))} (layers "
            f"{sorted(missing)}); level_recipes has {sorted(level_recipes)}: add them"
        )
    return {path: level_recipes[level] for path, level in levels.items()}
