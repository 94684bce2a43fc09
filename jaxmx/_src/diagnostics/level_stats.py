"""What one scaling level does to a tensor: :class:`LevelStats` and :func:`measure`, which
quantizes a tensor at each :class:`~jaxmx._src.diagnostics.levels.Level` and reads underflow,
flushing, saturation, SQNR and the span ratio of each group of elements sharing one scale.

Example:
    >>> import jax
    >>> from jaxmx._src.diagnostics.levels import levels_of
    >>> x = jax.random.normal(jax.random.key(0), (4, 128))
    >>> (stats,) = measure(x, axis=1, levels=(levels_of("fp8_e4m3")["mx32"],))
    >>> float(stats.groups), float(stats.flushed)
    (16.0, 0.0)
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmx._src.core import bits, exponents
from jaxmx._src.core.formats import Format
from jaxmx._src.diagnostics.levels import Level
from jaxmx._src.quantize.codec import decode_elements
from jaxmx._src.quantize.quantize import dequantize, quantize


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


MIN_SIDE = 256
"""Rows and columns of a measured tensor are padded with zeros to a power of two, at least this:
small tensors of many shapes then share one compiled program."""


def measure(x: jax.Array, *, axis: int, levels: tuple[Level, ...]) -> tuple[LevelStats, ...]:
    """The :class:`LevelStats` of each of ``levels`` (levels of one element format), ``x``'s
    ``axis`` (non-negative) the one the rows and blocks run along.

    ``x`` is measured as ``[lead, rows, columns]`` (``axis`` last, the axis before it the rows
    of 2-D tiles), padded with zeros to :func:`bucket`'s sides: one compiled program per
    bucket, ``lead`` and levels. The padding is not measured (every statistic reads the real
    elements and the groups holding one), so the result is that of ``x`` itself."""
    x = jnp.asarray(x)
    moved = (*x.shape[:axis], *x.shape[axis + 1 :], x.shape[axis])
    rows, cols = (1, *moved)[-2:]
    padded = _padded(x, axis, bucket(rows), bucket(cols))
    return _measure(padded, jnp.int32(rows), jnp.int32(cols), levels=levels)


def bucket(n: int) -> int:
    """The padded length of a side of ``n``: the power of two at or above it, at least
    :data:`MIN_SIDE`."""
    return max(MIN_SIDE, 1 << max(n - 1, 0).bit_length())


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _padded(x: jax.Array, axis: int, rows: int, cols: int) -> jax.Array:
    """float32 ``x`` as [lead, r, c] (``axis`` last), zero-padded to [lead, rows, cols]: one
    program with the transpose."""
    x = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    x = x.reshape(math.prod(x.shape[:-2]), *(1, *x.shape)[-2:])
    return jnp.pad(x, [(0, 0), (0, rows - x.shape[1]), (0, cols - x.shape[2])])


@functools.partial(jax.jit, static_argnames="levels")
def _measure(x: jax.Array, rows, cols, *, levels: tuple[Level, ...]) -> tuple[LevelStats, ...]:
    """:func:`measure` of the ``[:, :rows, :cols]`` corner of ``x`` [lead, R, C] (zero beyond)."""
    # the real extent as values XLA cannot fold: a constant mask would be evaluated element by
    # element at compile time
    rows, cols = jax.lax.optimization_barrier((rows, cols))
    valid = (jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) < rows) & (
        jax.lax.broadcasted_iota(jnp.int32, x.shape, 2) < cols
    )
    out = []
    for level in levels:
        q = quantize(x, level.format, tile=level.tile)
        codes = decode_elements(q.data, level.format)[tuple(slice(0, n) for n in x.shape)]
        xhat = dequantize(q, jnp.float32)
        values, real = _groups(x, valid, level)
        spans, in_group = _spans(values, real), jnp.any(real, axis=1)
        out.append(_level_stats(x, valid, codes, xhat, spans, in_group, level.format))
    return tuple(out)


def _groups(x: jax.Array, valid: jax.Array, level: Level) -> tuple[jax.Array, jax.Array]:
    """``x`` as ``[groups, size]`` (one group per scale of ``level``) and the mask of its real
    elements (``valid``'s; zero padding of partial blocks and tiles is not real either)."""
    if level.format.span == "tensor":
        return x.reshape(1, -1), valid.reshape(1, -1)
    if level.format.span == "row":
        return x.reshape(-1, x.shape[-1]), valid.reshape(-1, x.shape[-1])
    if level.tile is not None:
        rows, cols = level.tile
        pad = [(0, 0)] * (x.ndim - 2) + [(0, -x.shape[-2] % rows), (0, -x.shape[-1] % cols)]
        x, valid = jnp.pad(x, pad), jnp.pad(valid, pad)

        def tiles(a):
            a = a.reshape(-1, a.shape[-2] // rows, rows, a.shape[-1] // cols, cols)
            return a.transpose(0, 1, 3, 2, 4).reshape(-1, rows * cols)

        return tiles(x), tiles(valid)
    block = level.format.block
    pad = [(0, 0)] * (x.ndim - 1) + [(0, -x.shape[-1] % block)]
    x, valid = jnp.pad(x, pad), jnp.pad(valid, pad)
    return x.reshape(-1, block), valid.reshape(-1, block)


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
    exponent = exponents.exponent_and_mantissa(amax_bits)[0] - bits.EXPONENT_BIAS
    return exponents.scale_by_pow2(x, -jnp.clip(exponent, -127, 127))


def _spans(values: jax.Array, valid: jax.Array) -> jax.Array:
    """Each group's ``amax / std`` (population std of its real elements): ``inf`` where the std
    is 0 and ``amax > 0``, 0 for an all-zero group (or one of padding only); computed on the
    group scaled to its amax's binade (no overflow, no flushed subnormals)."""
    count = jnp.sum(valid, axis=1)
    amax_bits = jnp.max(jnp.where(valid, _magnitude_bits(values), 0), axis=1)
    values = _down_to_one(values, amax_bits[:, None])
    amax = jnp.max(jnp.where(valid, jnp.abs(values), 0.0), axis=1)
    mean = jnp.sum(jnp.where(valid, values, 0.0), axis=1) / count
    var = jnp.sum(jnp.where(valid, (values - mean[:, None]) ** 2, 0.0), axis=1) / count
    std = jnp.sqrt(var)
    all_zero = ~_bits_nonzero(amax_bits)
    return jnp.where(all_zero, 0.0, jnp.where(std == 0, jnp.inf, amax / std))


def _level_stats(x, valid, codes, xhat, spans, in_group, f: Format) -> LevelStats:
    """The statistics of the real elements of ``x`` (``valid``) and of the groups holding one
    (``in_group``; ``spans``: each group's :func:`_spans`)."""
    magnitude = _magnitude_bits(x)
    nonzero = _bits_nonzero(magnitude)  # subnormals are not zero; padding is zero
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

    groups = jnp.sum(in_group)
    ordered = jnp.sort(jnp.where(in_group, spans, jnp.inf))  # the real groups first

    def finite_only(value):
        return jnp.where(holds_nonfinite, jnp.nan, value).astype(jnp.float32)

    def quantile(q):  # the smallest span with at least q% of the groups at or below it
        # ceil(q * groups / 100) in int32 without overflow: groups = 100 a + b
        at_least = q * (groups // 100) + (q * (groups % 100) + 99) // 100
        return finite_only(ordered[jnp.maximum(at_least - 1, 0)])

    def share_of_groups(condition):
        return finite_only(jnp.sum(in_group & condition) / groups)

    return LevelStats(
        underflow=fraction(jnp.abs(codes) < 2.0**f.emin),
        flushed=fraction(codes == 0),
        saturated=fraction(clipped | overflow),
        sqnr_db=finite_only(sqnr),
        span_p50=quantile(50),
        span_p90=quantile(90),
        span_p99=quantile(99),
        span_max=finite_only(jnp.max(jnp.where(in_group, spans, 0.0))),
        span_above_2_10=share_of_groups(spans > 2.0**10),
        span_above_limit=share_of_groups(spans > f.elem_max / 2.0**f.emin),
        groups=groups.astype(jnp.float32),
        nonfinite=(jnp.sum(valid & ~jnp.isfinite(xhat)) / jnp.sum(valid)).astype(jnp.float32),
    )
