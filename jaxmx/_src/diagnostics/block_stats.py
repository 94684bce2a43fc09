"""Per-block quantization statistics: where outliers widen a block's span, and what underflows.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx import diagnostics
    >>> x = jnp.concatenate([jnp.full(31, 1e-3), jnp.array([100.0])])  # one outlier in a block
    >>> s = diagnostics.block_stats(x)
    >>> int(s.scale_exp[0]), float(s.underflow[0]), float(s.flushed[0])
    (-2, 0.96875, 0.0)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmx._src.core import bits, exponents, ieee_arithmetic
from jaxmx._src.core.blocks import blocked
from jaxmx._src.core.checks import normalize_axis
from jaxmx._src.core.dtypes import as_float_array
from jaxmx._src.core.explicit_axes import on_explicit_axes
from jaxmx._src.core.formats import Format, check_scale_mode, get_format
from jaxmx._src.core.support import lacks
from jaxmx._src.gemm.matmul import matmul
from jaxmx._src.quantize import nvfp4
from jaxmx._src.quantize.codec import decode_elements, scale_exponent_bytes
from jaxmx._src.quantize.quantize import dequantize, quantize
from jaxmx._src.quantize.scales import scaled_blocks

NAN_SCALE_EXP = 128
"""``BlockStats.scale_exp`` of a block whose scale is NaN (it, or for NVFP4 its tensor, holds
NaN or inf)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockStats:
    """Statistics of each quantization block (arrays shaped like ``quantize(x, ...).scale``).

    Only a block's real elements count (never the zero padding of a partial last block). For
    NVFP4, ``2^e`` below stands for the block's scale ``s * g`` (E4M3 block scale times tensor
    scale), and ``|x| / 2^e`` for ``x * r``, the value the quantizer rounds.

    Attributes:
        amax: the largest magnitude (float32; NaN or inf in a block holding one).
        scale_exp: the E8M0 exponent ``e`` of the block's scale ``2^e``; for NVFP4 the exponent
            of ``s * g`` (its binade). int32; 128 marks the NaN scale of a block holding NaN or
            inf (for NVFP4 also every block of a tensor holding one).
        span_ratio: ``amax / std`` (population standard deviation of the block's elements);
            ``inf`` when the std is 0 and ``amax > 0``, 0 for an all-zero block.
        underflow: the fraction of the block's non-zero elements ``x`` with ``|x| / 2^e`` below
            the element format's smallest normal (``2^-6`` for E4M3, ``2^-14`` for E5M2, 1 for
            E2M1 and E2M3, ``2^-2`` for E3M2): they lose precision as subnormals. MXINT8: below
            1, where its fixed 2^-6 step leaves an element fewer than 7 significant bits. 0 for
            an all-zero block.
        flushed: the fraction of the block's non-zero elements that quantize to zero.
        saturated: the fraction of non-zero elements with ``|x| / 2^e`` above the format's
            largest value, i.e. clipped (0 under ``rceil``), or whose dequantized value
            overflows float32 (inf; a block near float32's largest value).
        sqnr_db: ``10 log10(sum x^2 / sum (x - dequantized)^2)``; ``inf`` where the block is
            reproduced exactly (an all-zero block included), ``-inf`` where an element
            dequantizes to inf.

    The fractions and ``sqnr_db`` are NaN for blocks holding NaN or inf (the blocks with
    ``scale_exp == 128``: for NVFP4 every block of a tensor holding one).
    """

    amax: jax.Array
    scale_exp: jax.Array
    span_ratio: jax.Array
    underflow: jax.Array
    flushed: jax.Array
    saturated: jax.Array
    sqnr_db: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))

    def nonfinite_blocks(self) -> np.ndarray:
        """numpy bools, one per block: the blocks whose scale is NaN (``scale_exp == 128``):
        those holding NaN or inf, and for NVFP4 every block of a tensor holding one."""
        return np.asarray(self.scale_exp) == NAN_SCALE_EXP

    def summary(self, bins: int = 16) -> dict:
        """Tail statistics over all blocks, as Python numbers and numpy histograms.

        Keys: ``blocks``; ``span_ratio_p50`` / ``_p99`` / ``_max`` and, with ``span_limit`` the
        format's full-precision span (``elem_max`` over its smallest normal: 28672 for E4M3),
        ``frac_span_above_2^10`` and ``frac_span_above_limit``; ``frac_blocks_underflowing``
        (blocks with any underflow), ``underflow_mean`` / ``_max``, ``flushed_mean`` / ``_max``,
        ``saturated_max``; ``sqnr_db_min`` / ``_median``; ``nonfinite_blocks``; and histograms
        ``span_ratio_log2_hist`` and ``underflow_hist`` as ``(counts, edges)``. NaN/inf blocks
        are left out of every statistic but ``nonfinite_blocks``.
        """
        f = get_format(self.fmt)
        finite = ~self.nonfinite_blocks().ravel()

        def values(a):  # the finite blocks' values of a statistic
            return np.asarray(a, np.float64).ravel()[finite]

        span, under, flushed = values(self.span_ratio), values(self.underflow), values(self.flushed)
        saturated, sqnr = values(self.saturated), values(self.sqnr_db)
        limit = f.elem_max / 2.0**f.emin
        log_span = np.log2(span[(span > 0) & np.isfinite(span)])

        def stat(fn, a, empty=0.0):
            return float(fn(a)) if a.size else empty

        def percentile(q):
            return lambda a: np.percentile(a, q, method="nearest")

        return {
            "blocks": int(finite.sum()),
            "nonfinite_blocks": int((~finite).sum()),
            "span_limit": limit,
            "span_ratio_p50": stat(percentile(50), span),
            "span_ratio_p99": stat(percentile(99), span),
            "span_ratio_max": stat(np.max, span),
            "frac_span_above_2^10": stat(np.mean, span > 2.0**10),
            "frac_span_above_limit": stat(np.mean, span > limit),
            "frac_blocks_underflowing": stat(np.mean, under > 0),
            "underflow_mean": stat(np.mean, under),
            "underflow_max": stat(np.max, under),
            "flushed_mean": stat(np.mean, flushed),
            "flushed_max": stat(np.max, flushed),
            "saturated_max": stat(np.max, saturated),
            "sqnr_db_min": stat(np.min, sqnr, float("inf")),
            "sqnr_db_median": stat(np.median, sqnr, float("inf")),
            "span_ratio_log2_hist": np.histogram(log_span, bins=bins),
            "underflow_hist": np.histogram(under, bins=bins, range=(0.0, 1.0)),
        }


def block_stats(
    x: jax.Array, fmt: str = "mxfp8_e4m3", axis: int = -1, scale_mode: str | None = None
) -> BlockStats:
    """Statistics of each block of ``quantize(x, fmt, axis, scale_mode)`` (see :class:`BlockStats`).

    Jittable; every statistic is computed from ``x`` in float32 (``bfloat16`` / ``float16``
    inputs are upcast exactly) and the block's scale, with thresholds compared on the float32
    bits, so subnormal inputs are classified exactly on every platform.
    """
    f = get_format(fmt)
    if missing := lacks(f, "block_statistics"):
        raise ValueError(
            f"block_stats covers the MX formats (E8M0 scales) and NVFP4, not {f.name} "
            f"({missing}); see docs/diagnostics.md"
        )
    scale_mode = check_scale_mode(scale_mode, f)
    x = as_float_array(x, "block_stats: x")
    if x.ndim == 0:
        raise ValueError("block_stats expects an array of rank >= 1, got a scalar")
    axis = normalize_axis(axis, x.ndim)
    return on_explicit_axes(_block_stats, x, f=f, axis=axis, scale_mode=scale_mode)


@functools.partial(jax.jit, static_argnames=("f", "axis", "scale_mode"))
def _block_stats(x: jax.Array, *, f: Format, axis: int, scale_mode: str) -> BlockStats:
    """:func:`block_stats` of checked arguments: one compiled program per shape and setting."""
    q = quantize(x, f.name, axis=axis, scale_mode=scale_mode)
    xb = blocked(x, axis, f.block)  # [outer, n_blocks, block, inner]
    index = jnp.arange(xb.shape[1] * f.block).reshape(1, xb.shape[1], f.block, 1)
    valid = index < x.shape[axis]
    count = jnp.sum(valid, axis=2)  # elements per block: f.block, or fewer in the last
    block_shape = (xb.shape[0], xb.shape[1], 1, xb.shape[3])
    magnitude_bits = bits.to_bits(xb) & 0x7FFFFFFF
    amax_bits = jnp.max(magnitude_bits, axis=2)  # padding (zero) is never the maximum
    amax, all_zero = bits.from_bits(amax_bits), ~_bits_less(jnp.zeros_like(amax_bits), amax_bits)
    # Ratios are scale-free: compute them on the block divided by a power of two near its
    # scale (exactly), whose values are at most about elem_max, so no float32 arithmetic meets a
    # subnormal block (XLA:CPU flushes). ``scaled`` and ``codes``: the block and its quantized
    # values in those units.
    codes = decode_elements(q.data, f).reshape(xb.shape)
    if f.has_global_scale:
        s = nvfp4.block_scales(q.scale).reshape(block_shape)
        g = q.global_scale
        is_nan_scale = jnp.isnan(s)
        effective = ieee_arithmetic.multiply_exact(s, g)  # the block's scale s * g
        scale_exp = ((bits.to_bits(effective) >> bits.MANTISSA_BITS) & 0xFF) - bits.EXPONENT_BIAS
        scale_exp = jnp.where(is_nan_scale, NAN_SCALE_EXP, scale_exp)
        magnitude = jnp.abs(nvfp4.scaled_elements(xb, s, g))  # what the quantizer rounds
        below_normal, above_largest = magnitude < 2.0**f.emin, magnitude > f.elem_max
        # units: 2^k, the block's own power-of-two (MXFP4 rceil) scale
        byte, scaled = scaled_blocks(xb, get_format("mxfp4"), "rceil", None)
        k = jnp.minimum(byte - bits.EXPONENT_BIAS, 126)  # in [-127, 126]; NaN blocks masked
        codes = exponents.scale_by_pow2(
            ieee_arithmetic.multiply_exact(codes * s, g), -k
        )  # dequantized / 2^k
    else:
        byte = scale_exponent_bytes(q.scale).reshape(block_shape)
        is_nan_scale = byte == exponents.E8M0_NAN
        scale_exp = jnp.where(is_nan_scale, NAN_SCALE_EXP, byte - bits.EXPONENT_BIAS)
        scaled = exponents.scale_by_pow2(xb, -jnp.where(is_nan_scale, 0, scale_exp))  # exact
        # thresholds on the scaled value |x| / 2^e, moved to x's scale and compared as bits
        smallest_normal = exponents.ldexp_exact(jnp.float32(2.0**f.emin), scale_exp)
        largest = exponents.ldexp_exact(jnp.float32(f.elem_max), scale_exp)
        below_normal = _bits_less(magnitude_bits, bits.to_bits(smallest_normal))
        above_largest = _bits_less(bits.to_bits(largest), magnitude_bits)
    mean = jnp.sum(scaled, axis=2, keepdims=True) / count[:, :, None]
    variance = jnp.sum(jnp.where(valid, (scaled - mean) ** 2, 0.0), axis=2) / count
    std = jnp.sqrt(variance)
    amax_scaled = jnp.max(jnp.abs(scaled), axis=2)
    span = jnp.where(all_zero, 0.0, jnp.where(std == 0, jnp.inf, amax_scaled / std))

    nonzero = valid & _bits_less(jnp.zeros_like(magnitude_bits), magnitude_bits)
    n_nonzero = jnp.sum(nonzero, axis=2)

    def fraction(condition):
        hits = jnp.sum(nonzero & condition, axis=2)
        return jnp.where(n_nonzero > 0, hits / jnp.maximum(n_nonzero, 1), 0.0)

    # a finite element whose dequantized value is inf (block near float32's largest value)
    dequantized = blocked(dequantize(q, jnp.float32), axis, f.block)
    overflow = jnp.isfinite(xb) & ~jnp.isfinite(dequantized)
    underflow = fraction(below_normal)
    saturated = fraction(above_largest | overflow)
    flushed = fraction(codes == 0)
    signal = jnp.sum(scaled**2, axis=2)
    noise = jnp.sum(jnp.where(valid, (scaled - codes) ** 2, 0.0), axis=2)
    noise = jnp.where(jnp.any(valid & overflow, axis=2), jnp.inf, noise)
    sqnr = jnp.where(noise == 0, jnp.inf, 10 * jnp.log10(signal / noise))

    nonfinite = jnp.squeeze(is_nan_scale, 2)

    def per_block(a, nan_where_nonfinite=True):
        a = jnp.where(nonfinite, jnp.nan, a) if nan_where_nonfinite else a
        return a.reshape(q.scale.shape)

    return BlockStats(
        amax=per_block(amax, nan_where_nonfinite=False),
        scale_exp=per_block(jnp.squeeze(scale_exp, 2), nan_where_nonfinite=False),
        span_ratio=per_block(span),
        underflow=per_block(underflow),
        flushed=per_block(flushed),
        saturated=per_block(saturated),
        sqnr_db=per_block(sqnr),
        fmt=f.name,
    )


def _bits_less(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a < b`` for the bits of non-negative float32 values, subnormals included.

    Compared field by field: XLA:CPU's compiler turns a plain integer comparison of a float's
    masked bits into a float comparison, which treats subnormals as zero under its flush mode.
    """
    a_exp, b_exp = a >> bits.MANTISSA_BITS, b >> bits.MANTISSA_BITS
    a_man, b_man = a & bits.MANTISSA_MASK, b & bits.MANTISSA_MASK
    return (a_exp < b_exp) | ((a_exp == b_exp) & (a_man < b_man))


def gemm_probe(
    m: int,
    n: int,
    k: int,
    *,
    fmt: str = "mxfp8_e4m3",
    accum_bits: int | None = None,
    promote_every: int | None = None,
    distribution: str = "normal",
    key: jax.Array,
) -> dict[str, float]:
    """Accumulation error of an MX GEMM ``[m, k] @ [k, n]`` of random operands, against float64.

    Both operands are quantized along K (``fmt``, ``rceil``); their exact MX product (float64) is
    the reference, so the error measured is the accumulation's alone. The accumulation model:

    - ``accum_bits=None``: float32 accumulation (the emulated GEMM);
    - ``accum_bits=b``: in steps of 32 products, the running sum and the 32 products are aligned
      to the largest exponent among them and truncated (toward zero) to ``b`` bits below it,
      then added (the model of Hopper's FP8 tensor cores in DeepSeek-V3's report, which keeps
      about 14 bits);
    - ``promote_every=c`` (a multiple of 32, with ``accum_bits``): every ``c`` elements of K the
      limited sum is added to a float32 accumulator and restarted, as DeepSeek-V3 does with
      ``c = 128``.

    The same accumulator is available to training as ``Recipe(accum_bits=b, promote_every=c)``
    (:func:`jaxmx.matmul` takes both too).

    Args:
        m, n, k: the GEMM's sizes.
        fmt: the operands' MX format.
        accum_bits, promote_every: the accumulation model above.
        distribution: ``"normal"`` (standard normal operands) or ``"uniform"`` (in [0, 1): every
            product positive, so the truncation errors add up).
        key: a PRNG key for the operands.

    Returns:
        ``{"max_rel": max |C - R| / max |R|, "fro_rel": ||C - R|| / ||R||,
        "quantization_fro_rel": ||R - X|| / ||X||}`` with ``R`` the exact MX product and ``X``
        the float64 product of the unquantized operands (the quantization error, for scale).
    """
    f = get_format(fmt)
    for name, size in (("m", m), ("n", n), ("k", k)):
        if isinstance(size, bool) or not hasattr(size, "__index__") or size < 1:
            raise ValueError(f"gemm_probe: {name} must be a positive integer, got {size!r}")
    if distribution not in ("normal", "uniform"):
        raise ValueError(f"distribution must be 'normal' or 'uniform', got {distribution!r}")
    a, b, a_q, b_q, result = _probe_gemm(
        key,
        f=f,
        sizes=(m, n, k),
        dist=distribution,
        accum_bits=accum_bits,
        promote_every=promote_every,
    )
    a_q, b_q = (np.asarray(q, np.float64) for q in (a_q, b_q))
    exact = a_q @ b_q.T  # float64: its rounding is far below any accumulator modelled here
    error = np.asarray(result, np.float64) - exact
    unquantized = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
    return {
        "max_rel": float(np.abs(error).max() / np.abs(exact).max()),
        "fro_rel": float(np.linalg.norm(error) / np.linalg.norm(exact)),
        "quantization_fro_rel": float(
            np.linalg.norm(exact - unquantized) / np.linalg.norm(unquantized)
        ),
    }


@functools.partial(jax.jit, static_argnames=("f", "sizes", "dist", "accum_bits", "promote_every"))
def _probe_gemm(key, *, f: Format, sizes, dist: str, accum_bits, promote_every):
    """:func:`gemm_probe`'s operands ``a`` [m, k] and ``b`` [n, k] drawn from ``dist``, their
    decoded MX values and the modelled GEMM of those: one compiled program per setting."""
    m, n, k = sizes
    a_key, b_key = jax.random.split(key)
    if dist == "normal":
        a, b = jax.random.normal(a_key, (m, k)), jax.random.normal(b_key, (n, k))
    else:
        a, b = (jax.random.uniform(s, shape) for s, shape in ((a_key, (m, k)), (b_key, (n, k))))
    a_q, b_q = quantize(a, f.name), quantize(b, f.name)
    result = matmul(
        a_q, b_q, jnp.float32, "emulate", accum_bits=accum_bits, promote_every=promote_every
    )
    return a, b, dequantize(a_q), dequantize(b_q), result
