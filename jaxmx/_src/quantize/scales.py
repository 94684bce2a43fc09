"""The scale rules of each scale kind: a block's scale from its absolute maximum, its elements in
units of that scale, and the way back. One object per
:class:`~jaxmx._src.core.scale_kinds.ScaleKind` (:data:`RULES`), so that the quantizers, the Pallas
kernels, fake quantization, diagnostics and the emulation ask the format's kind instead of testing
the format.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core.blocks import blocked
    >>> from jaxmx._src.core.formats import get_format
    >>> from jaxmx._src.quantize.scales import rule_of
    >>> f = get_format("mxfp8_e4m3")
    >>> codes, values, _ = rule_of(f).scaled(blocked(jnp.full((32,), 3.0), 0, 32), f, "rceil")
    >>> codes.ravel().tolist(), float(values.max())        # scale 2^-7: 3 / 2^-7 = 384
    ([120], 384.0)
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmx._src.core import bits, exponents, ieee_arithmetic
from jaxmx._src.core.formats import Format
from jaxmx._src.core.reductions import max_along
from jaxmx._src.quantize import nvfp4
from jaxmx._src.quantize.codec import scale_back, scale_exponent_bytes
from jaxmx._src.quantize.rounding import round_stochastically, rounding


def scaled_blocks(xb, f: Format, scale_mode: str, noise, block_axes=(2,)):
    """(E8M0 bytes [outer, n_blocks, 1, inner] int32, elements divided by their scale and clamped
    to ``±elem_max``) of ``xb`` = :func:`blocked`'s output; with ``noise`` (uniform [0, 1)
    draws shaped like ``xb``, see :func:`uniform_noise`) the elements are rounded stochastically.
    ``block_axes``: the axes a block spans, ``(2, 4)`` for 2-D tiles in their place
    (:func:`~jaxmx._src.core.blocks.tile_view`; the bytes then keep both axes, as size 1).

    The elements are not yet rounded to the element grid (unless ``noise`` rounded them): the
    quantizer encodes them (round to nearest even), the fake quantizer rounds them in float32.
    """
    x_bits = bits.to_bits(xb)
    magnitude_bits = x_bits & 0x7FFFFFFF  # integer order == float order (NaN above inf)

    def byte_of(amax_bits):
        return exponents.scale_bytes(amax_bits, f.emax, _round_up(amax_bits, f, scale_mode))

    if block_axes != (2,):
        byte = byte_of(max_along(magnitude_bits, block_axes, keepdims=True))
        exponent = bits.where(byte == exponents.E8M0_NAN, 128, byte - bits.EXPONENT_BIAS)
        return byte, _clipped(exponents.scale_by_pow2(xb, -exponent), f, noise)
    if xb.shape[3] == 1:
        # Blocks along the minor axis. The byte is a non-decreasing function of amax's bits in
        # every mode, so the block maximum of the per-element bytes IS the byte of the block's
        # amax. Reducing the bytes makes the reduction output the final per-block value, and the
        # element fusion no longer recomputes the scale rule for each of its elements: ~20%
        # faster on XLA:CPU, identical bytes. (For blocks along another axis it is slower.)
        byte = max_along(byte_of(magnitude_bits), 2)
    else:
        byte = byte_of(max_along(magnitude_bits, 2))
    exponent = bits.where(byte == exponents.E8M0_NAN, 128, byte - bits.EXPONENT_BIAS)
    scaled = exponents.scale_by_pow2(xb, -exponent, axis=2)
    return jnp.expand_dims(byte, 2), _clipped(scaled, f, noise)


def _clipped(scaled, f: Format, noise):
    """``scaled`` rounded stochastically with ``noise`` (if any), clipped to ``±elem_max``."""
    if noise is not None:
        scaled = round_stochastically(scaled, f, noise)
    return bits.clip(scaled, -f.elem_max, f.elem_max)


def float32_scaled_blocks(xb, f: Format, scale_mode: str, noise, block_axes=(2,)):
    """Block FP8: (float32 scales [outer, n_blocks, 1, inner] (:data:`jaxmx.BLOCK_SCALE_MODES`),
    elements ``x / s`` clipped to ``±elem_max``), as :func:`scaled_blocks` for the MX formats:
    the codes are ``encode(x / s)``."""
    amax_bits = max_along(bits.to_bits(xb) & 0x7FFFFFFF, block_axes, keepdims=True)
    amax = bits.from_bits(amax_bits)
    if scale_mode == "fp32":
        scale = jnp.maximum(ieee_arithmetic.divide(amax, f.elem_max), jnp.float32(2.0**-126))
    else:  # pow2: the rceil exponent, k >= -127, exact
        byte = exponents.scale_bytes(amax_bits, f.emax, _round_up(amax_bits, f, "rceil"))
        scale = exponents.ldexp_exact(
            bits.filled_like(amax, 1.0, jnp.float32), byte - bits.EXPONENT_BIAS
        )
    exponent = amax_bits >> bits.MANTISSA_BITS
    # zero tested field by field: XLA:CPU may turn `bits == 0` into a float compare, which
    # treats a subnormal amax as zero
    all_zero = (exponent == 0) & ((amax_bits & bits.MANTISSA_MASK) == 0)
    scale = bits.where(exponent == 0xFF, jnp.nan, bits.where(all_zero, 1.0, scale))
    # x / s as the quotient of normal floats: both scaled by 2^64 where s is tiny, so no
    # subnormal operand meets a flushing division (the quotient is unchanged)
    boost = bits.where(scale < 2.0**-60, 64, 0)
    scaled = ieee_arithmetic.divide(
        exponents.scale_by_pow2(xb, boost), exponents.scale_by_pow2(scale, boost)
    )
    return scale, _clipped(scaled, f, noise)


def _round_up(amax_bits, f: Format, scale_mode: str):
    """Whether the block exponent is one above floor(log2(amax)) - emax, per scale mode (a
    subnormal amax normalized where that can change the byte: emax 0, MXINT8; see
    :func:`~jaxmx._src.core.exponents.scale_bytes`)."""
    if f.emax < 1:
        _, mantissa = exponents.exponent_and_mantissa(amax_bits)
    else:
        mantissa = amax_bits & bits.MANTISSA_MASK
    if scale_mode == "floor":
        return jnp.zeros_like(mantissa)
    if scale_mode == "ceil":
        return mantissa != 0
    if scale_mode == "rceil":  # amax / elem_max > 2^k  <=>  mantissa(amax) > mantissa(elem_max)
        # ... except where cuBLAS/TransformerEngine's d = amax * fl32(1/elem_max) is a float32
        # subnormal: for amax = elem_max * 2^-127 * (1 + 2^-23) (biased exponent emax, mantissa
        # one above elem_max's) d rounds to exactly 2^-127 (m == 0x400000), which their rule does
        # not round up: byte 0. Checked against the literal formula for every float32 amax.
        edge = ((amax_bits >> bits.MANTISSA_BITS) == f.emax) & (mantissa == f.elem_max_mantissa + 1)
        return (mantissa > f.elem_max_mantissa) & ~edge
    half_ulp = 1 << (bits.MANTISSA_BITS - f.mbits - 1)  # "even": does rounding amax carry?
    return mantissa + half_ulp > bits.MANTISSA_MASK


class ScaleRule(abc.ABC):
    """The rules every :class:`~jaxmx._src.core.scale_kinds.ScaleKind` answers (:data:`RULES`).
    ``scaled``, ``decoded`` and ``units`` are each kind's own; the others default to float32
    scales stored as they are, no tensor scale, and no row-relative decode.

    Example:
        >>> from jaxmx._src.core.formats import get_format
        >>> rule = rule_of(get_format("fp8_e4m3_block"))
        >>> isinstance(rule, ScaleRule), rule.scales(jnp.float32(0.5)).tolist()
        (True, 0.5)
    """

    # the kind's scales and what the decode of an element computes, for the messages
    described: ClassVar[str] = "these scales"
    decode: ClassVar[str] = "code * s"

    @abc.abstractmethod
    def scaled(self, xb, f: Format, scale_mode: str, noise=None, g=None, block_axes=(2,)):
        """``(scale codes, elements in units of their scale and clipped, tensor scale or None)``
        of blocks ``xb`` (:func:`~jaxmx._src.core.blocks.blocked`), rounded stochastically
        with ``noise``. ``block_axes``: the axes a block spans, ``(2, 4)`` for 2-D tiles in
        their place (:func:`~jaxmx._src.core.blocks.tile_view`; the scale codes keep both
        axes, as size 1), for the kinds that take tiles."""

    @abc.abstractmethod
    def decoded(self, values: jax.Array, scale: jax.Array) -> jax.Array:
        """Decoded elements times their scales, rounded as the kind defines."""

    @abc.abstractmethod
    def units(self, xb: jax.Array, scale: jax.Array, g=None) -> jax.Array:
        """``xb`` in units of the given scales (before rounding), as the quantizer computes."""

    def scales(self, codes: jax.Array) -> jax.Array:
        """The stored scales of :meth:`scaled`'s scale codes (float32 scales: as they are)."""
        return codes

    def tensor_scale(self, x: jax.Array) -> jax.Array | None:
        """The tensor scale the kind computes for ``x``, where it has one (here: None)."""
        return None

    def with_tensor_scale(self, out: jax.Array, g) -> jax.Array:
        """``out`` times the tensor scale, where the kind has one (here: none)."""
        return out

    def relative_to_rows(self, values: jax.Array, scale: jax.Array, k: int):
        """``(values * 2^(e - s), s)``: each row relative to its largest scale, exactly (the
        emulation's operands). Kinds whose decode rounds have none: a ValueError."""
        raise ValueError(
            f"{self.described} have no exact row-relative decode "
            f"({self.decode} is rounded); the dequantized emulation takes them"
        )


@dataclasses.dataclass(frozen=True)
class _E8M0Rule(ScaleRule):
    """The OCP MX scales: E8M0 powers of two, chosen by :data:`jaxmx.SCALE_MODES`."""

    def scaled(self, xb, f: Format, scale_mode: str, noise=None, g=None, block_axes=(2,)):
        """``(scale codes [outer, n_blocks, 1, inner] uint8, elements in units of their scale
        and clipped, None)`` of blocks ``xb`` (:func:`~jaxmx._src.core.blocks.blocked`), rounded
        stochastically with ``noise`` (else left to the encoder's round to nearest even)."""
        byte, values = scaled_blocks(xb, f, scale_mode, noise, block_axes)
        return byte.astype(jnp.uint8), values, None

    def scales(self, codes: jax.Array) -> jax.Array:
        """The stored scales of :meth:`scaled`'s scale codes."""
        return lax.bitcast_convert_type(codes, jnp.float8_e8m0fnu)

    def decoded(self, values: jax.Array, scale: jax.Array) -> jax.Array:
        """Decoded elements times their block scales, exactly (subnormal results included)."""
        return scale_back(values, scale_exponent_bytes(scale))

    def units(self, xb: jax.Array, scale: jax.Array, g=None) -> jax.Array:
        """``xb`` in units of the given block scales (before rounding): ``x * 2^-e``, exact;
        NaN under the NaN scale."""
        byte = scale_exponent_bytes(scale)
        units = exponents.scale_by_pow2(xb, bits.EXPONENT_BIAS - jnp.minimum(byte, 254))
        return bits.where(byte == exponents.E8M0_NAN, jnp.nan, units)

    def with_tensor_scale(self, out: jax.Array, g) -> jax.Array:
        """``out`` (decoded elements times block scales) times the tensor scale, if the kind
        has one."""
        return out

    def relative_to_rows(self, values: jax.Array, scale: jax.Array, k: int):
        """``(values * 2^(e - s), s)`` for blocked values ``[..., KB, block, ...]`` (K blocks at
        axis ``k``) with block exponents ``e``: each row's values relative to its largest
        finite scale ``2^s`` (so at most ``elem_max``), exact, subnormals included; NaN in a
        block with the NaN scale. ``s`` is int32, shaped like the rows."""
        relative, row_max, nan = relative_exponents(scale, k)
        # 2^relative in two exact factors, so exponents below -126 give subnormals (not zero);
        # computed per block and only then expanded over the block's elements
        high = jnp.expand_dims(exponents.pow2(jnp.maximum(relative, -126)), k + 1)
        low = jnp.expand_dims(exponents.pow2(jnp.minimum(relative + 126, 0)), k + 1)
        scaled = bits.where(jnp.expand_dims(nan, k + 1), jnp.nan, values * high * low)
        return scaled, row_max


def relative_exponents(scale: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(e - s, s, nan)`` for E8M0 block scales ``2^e`` with their K blocks at axis ``k``: each
    block's exponent relative to its row's largest finite one ``s`` (int32, ``<= 0``; ``s`` is
    shaped like the rows), and where the scale is NaN (those blocks count as ``2^-127``).

    Example:
        >>> import jax.numpy as jnp
        >>> scale = jnp.array([[1.0, 8.0, float("nan")]], jnp.float8_e8m0fnu)
        >>> [x.tolist() for x in relative_exponents(scale, 1)]
        [[[-3, 0, -130]], [3], [[False, False, True]]]
    """
    byte = scale_exponent_bytes(scale)
    nan = byte == exponents.E8M0_NAN
    exponent = bits.where(nan, 0, byte) - bits.EXPONENT_BIAS
    # over K, per row (an empty K gives the smallest exponent)
    row_max = jnp.max(exponent, axis=k, keepdims=True, initial=-bits.EXPONENT_BIAS)
    return exponent - row_max, jnp.squeeze(row_max, k), nan


@dataclasses.dataclass(frozen=True)
class _Float32Rule(ScaleRule):
    """Block FP8's float32 scales, chosen by :data:`jaxmx.BLOCK_SCALE_MODES`."""

    described: ClassVar[str] = "float32 block scales"

    def scaled(self, xb, f: Format, scale_mode: str, noise=None, g=None, block_axes=(2,)):
        scale, values = float32_scaled_blocks(xb, f, scale_mode, noise, block_axes)
        return scale, values, None

    def decoded(self, values: jax.Array, scale: jax.Array) -> jax.Array:
        """``values * scale`` rounded as IEEE float32, without flushing subnormals.

        A subnormal scale (``2^-127`` under ``pow2``) is scaled up by ``2^64`` and the element
        down by as much (both exact: elements are zero or at least ``2^-16``), then
        :func:`~jaxmx._src.core.ieee_arithmetic.multiply_exact` rounds the product, subnormal or
        not; normal products are the plain float32 product."""
        scale = jnp.broadcast_to(scale, values.shape)
        boost = bits.where((bits.to_bits(scale) & 0x7F800000) == 0, 64, 0)
        return ieee_arithmetic.multiply_exact(
            exponents.scale_by_pow2(values, -boost), exponents.scale_by_pow2(scale, boost)
        )

    def units(self, xb: jax.Array, scale: jax.Array, g=None) -> jax.Array:
        """``x / s`` as the quantizer divides (:func:`float32_scaled_blocks`)."""
        boost = bits.where(scale < 2.0**-60, 64, 0)
        return ieee_arithmetic.divide(
            exponents.scale_by_pow2(xb, boost), exponents.scale_by_pow2(scale, boost)
        )


@dataclasses.dataclass(frozen=True)
class _TensorScaledE4M3Rule(ScaleRule):
    """NVFP4's E4M3 block scales under a float32 tensor scale ``g``
    (:mod:`jaxmx._src.quantize.nvfp4`); ``g=None`` computes it from the blocks."""

    def scaled(self, xb, f: Format, scale_mode: str, noise=None, g=None, block_axes=(2,)):
        return nvfp4.scaled_blocks(xb, f, g, rounding(f, noise), block_axes)

    def scales(self, codes: jax.Array) -> jax.Array:
        return lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)

    def decoded(self, values: jax.Array, scale: jax.Array) -> jax.Array:
        return values * nvfp4.block_scales(scale)  # code * s: exact

    def tensor_scale(self, x: jax.Array) -> jax.Array:
        """:func:`~jaxmx._src.quantize.nvfp4.tensor_scale` of ``x``."""
        return nvfp4.tensor_scale(x)

    def with_tensor_scale(self, out: jax.Array, g) -> jax.Array:
        """``out`` times ``g``, rounded as IEEE float32 (one ``g`` per leading vmap dim)."""
        return ieee_arithmetic.multiply_exact(out, g.reshape(g.shape + (1,) * (out.ndim - g.ndim)))

    def units(self, xb: jax.Array, scale: jax.Array, g=None) -> jax.Array:
        """``x * min((1 / g) / s, float32 max)`` as the quantizer scales
        (:func:`~jaxmx._src.quantize.nvfp4.scaled_elements`)."""
        return nvfp4.scaled_elements(xb, nvfp4.block_scales(scale), g)

    def relative_to_rows(self, values: jax.Array, scale: jax.Array, k: int):
        """``(code * s, 0)``: exact in float32 as they are (the tensor scale left out)."""
        scaled = values * jnp.expand_dims(nvfp4.block_scales(scale), k + 1)
        return scaled, jnp.zeros(scaled.shape[:k] + scaled.shape[k + 2 :], jnp.int32)


AMAX_FLOOR = 1e-12
"""The smallest amax a per-tensor or per-row scale divides by (torchao's ``EPS``)."""


def _smallest_float32_at_least(v: float) -> np.float32:
    t = np.float32(v)
    return t if float(t) >= v else np.nextafter(t, np.float32(np.inf))


def current_scaled(xb, f: Format, scale_mode: str, noise):
    """Per-tensor or per-row FP8 (torchao's current scaling): (float32 scales, elements
    ``x * scale`` clipped to ``±elem_max``) of ``xb`` = :func:`blocked`'s view with the whole
    axis as its block, ``[outer, 1, n, inner]``; the scales are ``[outer, 1, 1, inner]`` (one per
    row) or ``[1, 1, 1, 1]`` (one per tensor). See :data:`jaxmx.CURRENT_SCALE_MODES`.

    ``scale = float32(elem_max / max(amax, 1e-12))``: for ``amax`` of at least 1e-12 the float32
    quotient ``elem_max / amax`` (the float64 quotient rounded to float32 is the same number:
    53 >= 2 * 24 + 2 bits make the double rounding innocuous), below it a constant. Every scale
    is a normal float32 (at least ``448 / max_float32``), so ``x * scale`` and ``code / scale``
    need no subnormal care beyond XLA's.
    """
    reduced = (2,) if f.span == "row" else (0, 1, 2, 3)
    amax_bits = max_along(bits.to_bits(xb) & 0x7FFFFFFF, reduced, keepdims=True)
    scale = current_scale(amax_bits, f, scale_mode)
    return scale, _clipped(xb * scale, f, noise)


def current_scale(amax_bits, f: Format, scale_mode: str):
    """The per-tensor or per-row FP8 scale of an amax given by its float32 bits (``int32``,
    sign cleared): :func:`current_scaled`'s rule, for callers that reduce the amax themselves
    (e.g. over the shards of a ``shard_map`` axis)."""
    amax = bits.from_bits(amax_bits)
    floor = _smallest_float32_at_least(AMAX_FLOOR)
    floor_bits = int(floor.view(np.uint32))
    at_floor = np.float32(f.elem_max / AMAX_FLOOR)  # float64 quotient, rounded once
    large = amax_bits >= floor_bits
    scale = ieee_arithmetic.divide(f.elem_max, bits.where(large, amax, 1.0))
    scale = bits.where(large, scale, at_floor)
    if scale_mode == "pow2":  # 2^floor(log2(scale)): the scale is normal, drop its mantissa
        scale = bits.from_bits(bits.to_bits(scale) & ~bits.MANTISSA_MASK)
    return bits.where((amax_bits >> bits.MANTISSA_BITS) == 0xFF, jnp.nan, scale)


@dataclasses.dataclass(frozen=True)
class _CurrentRule(ScaleRule):
    """Per-tensor and per-row FP8: one float32 scale per tensor or row (:func:`current_scaled`);
    a value is ``code / scale``."""

    described: ClassVar[str] = "per-tensor and per-row float32 scales"
    decode: ClassVar[str] = "code / scale"

    def scaled(self, xb, f: Format, scale_mode: str, noise=None, g=None, block_axes=(2,)):
        if block_axes != (2,):  # the quantizer refuses tiles for these formats first
            raise ValueError(f"{f.name} has one scale per row or tensor: no 2-D tiles")
        scale, values = current_scaled(xb, f, scale_mode, noise)
        return scale, values, None

    def decoded(self, values: jax.Array, scale: jax.Array) -> jax.Array:
        """``values / scale`` rounded as IEEE float32 division (as torchao decodes)."""
        return ieee_arithmetic.divide(values, scale)

    def units(self, xb: jax.Array, scale: jax.Array, g=None) -> jax.Array:
        """``x * scale`` as the quantizer scales (:func:`current_scaled`)."""
        return xb * scale


RULES = {
    "e8m0": _E8M0Rule(),
    "float32": _Float32Rule(),
    "e4m3": _TensorScaledE4M3Rule(),
    "float32_current": _CurrentRule(),
    "float32_pow2": _Float32Rule(),
}
"""The rules of each :class:`~jaxmx._src.core.scale_kinds.ScaleKind`, by its name."""


def rule_of(f: Format) -> ScaleRule:
    """The scale rules of ``f``'s scale kind."""
    return RULES[f.scale_kind.name]
