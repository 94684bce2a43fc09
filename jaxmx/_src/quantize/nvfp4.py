"""NVFP4 numerics: E2M1 elements in 16-element blocks, E4M3 block scales, a float32 tensor scale.

The rules (those of torchao's ``nvfp4_quantize`` with a per-tensor scale), all in float32 with
round to nearest even:

- tensor scale ``g = amax(|x|) / (448 * 6)``, at least ``2^-126`` (so an all-zero or tiny
  tensor gets a normal scale instead of a division by zero), NaN if ``x`` holds NaN or inf;
- block scale ``s = E4M3(clip((block_amax / 6) / g, 2^-6, 448))``, NaN for a block holding NaN
  or inf (or when ``g`` is NaN);
- ``r = min((1 / g) / s, float32 max)`` (the clamp keeps ``0 * r`` zero in tensors whose
  ``amax`` is below about ``6e-34``, where ``r`` would overflow);
- code ``E2M1(clip(x * r, -6, 6))``; zero in a block whose scale is NaN;
- value ``(code * s) * g``.

Each step equals the IEEE float32 formula, subnormal operands and results included, although
XLA:CPU flushes float32 subnormals: those cases are computed from integers or scaled by 2^64.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.arange(16.0), "nvfp4")   # g = 15 / 2688, s = 448: r = 0.4
    >>> q.scale.astype(float).tolist(), q.data[::5].astype(float).tolist()
    ([448.0], [0.0, 2.0, 4.0, 6.0])
    >>> jaxmx.dequantize(q)[::5].tolist()
    [0.0, 5.0, 10.0, 15.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmx._src.core import bits, exponents, ieee_arithmetic, minifloat_codec, wire
from jaxmx._src.core.formats import Format
from jaxmx._src.core.reductions import max_along

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
GLOBAL_DIVISOR = E4M3_MAX * 6.0  # g = amax / (448 * 6)
MIN_GLOBAL_SCALE = 2.0**-126
_BOOST = 64  # operands scaled by 2^64 where a subnormal would meet XLA:CPU's flushing
_FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)


def global_scale_of(amax_bits: jax.Array) -> jax.Array:
    """``g`` of a tensor whose largest magnitude has the float32 bits ``amax_bits`` (a scalar)."""
    amax = bits.from_bits(amax_bits)
    g = jnp.maximum(ieee_arithmetic.divide(amax, GLOBAL_DIVISOR), jnp.float32(MIN_GLOBAL_SCALE))
    return bits.where(amax_bits >= 0x7F800000, jnp.nan, g)


def tensor_scale(x: jax.Array) -> jax.Array:
    """The tensor scale ``g`` of ``x`` (:func:`global_scale_of` of its largest magnitude), as
    the quantizer computes it."""
    amax_bits = max_along(bits.to_bits(bits.upcast_exact(x)) & 0x7FFFFFFF)
    return global_scale_of(amax_bits)


def checked_global_scale(g, f: Format) -> jax.Array | None:
    """A user's ``global_scale`` as a float32 scalar (at least ``2^-126``), or None.

    A concrete value must be positive and finite (a ValueError otherwise); a traced one (under
    ``jit``) cannot be checked and is taken as it is: a negative or zero one is raised to
    ``2^-126``, a NaN one makes every block NaN.
    """
    if g is None:
        return None
    if not f.has_global_scale:
        raise ValueError(f"quantize: global_scale is NVFP4's per-tensor scale; {f.name} has none")
    g = jnp.asarray(g)
    if g.shape != () or not jnp.issubdtype(g.dtype, jnp.floating):
        raise TypeError(f"quantize: global_scale must be a float scalar, got {g.dtype}{g.shape}")
    if not isinstance(g, jax.core.Tracer):  # numpy: a jnp comparison would trace under a trace
        value = np.asarray(g)
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"quantize: global_scale must be positive and finite, got {value}")
    return jnp.maximum(g.astype(jnp.float32), jnp.float32(MIN_GLOBAL_SCALE))


def scaled_blocks(xb: jax.Array, f: Format, g: jax.Array | None, round_values, block_axes=(2,)):
    """``(E4M3 scale bytes [outer, n_blocks, 1, inner] uint8, elements, g)``: the elements of
    the quantizer before their cast to E2M1 (in units of their block scale, clipped
    to ``±6``, zero in a block whose scale is NaN; not yet rounded unless ``round_values``
    rounds them). ``block_axes``: the axes a block spans (``(2, 4)``: tiles in their place)."""
    magnitude_bits = bits.to_bits(xb) & 0x7FFFFFFF
    block_amax_bits = max_along(magnitude_bits, block_axes, keepdims=True)
    if g is None:
        g = global_scale_of(max_along(block_amax_bits))  # an empty x: as all-zero
    b = _block_ratio(block_amax_bits, g)
    nonfinite = (block_amax_bits >= 0x7F800000) | jnp.isnan(g)
    s = bits.where(nonfinite, jnp.nan, bits.clip(b, E4M3_MIN_NORMAL, E4M3_MAX))
    # s >= 2^-6 is never an E4M3 subnormal: only subnormals would be rounded by `round` (which
    # Pallas' Triton lowering lacks)
    scale_codes = minifloat_codec.encode_fp8(s, mbits=3, emin=-6, on_grid=True)
    s = block_scales(scale_codes)
    scaled = scaled_elements(xb, s, g)
    values = bits.clip(round_values(scaled), -f.elem_max, f.elem_max)
    return scale_codes, bits.where(jnp.isnan(s), 0.0, values), g


def block_scales(scale: jax.Array) -> jax.Array:
    """float32 values of E4M3 block scales (``float8_e4m3fn`` or their ``uint8`` bytes),
    exactly; NaN for the NaN code."""
    return minifloat_codec.decode_fp8(wire.as_bytes(scale), mbits=3, emin=-6, ieee_specials=False)


def scaled_elements(xb: jax.Array, s: jax.Array, g: jax.Array) -> jax.Array:
    """``x * r`` with ``r = min((1 / g) / s, float32 max)``: the elements of blocks ``xb`` in
    units of their block's scale, before rounding and clipping (float32 block scales ``s``
    broadcast against ``xb``)."""
    r = jnp.minimum(ieee_arithmetic.divide(ieee_arithmetic.divide(1.0, g), s), _FLOAT32_MAX)
    # where r >= 2^64, as (x * 2^64) * (r * 2^-64) so that a subnormal x is not flushed
    boost = bits.where(r >= 2.0**_BOOST, _BOOST, 0)
    return exponents.scale_by_pow2(xb, boost) * (r * exponents.pow2(-boost))


def _block_ratio(amax_bits: jax.Array, g: jax.Array) -> jax.Array:
    """``(amax / 6) / g`` in IEEE float32 for block maxima given by their bits."""
    amax = bits.from_bits(amax_bits)
    sixth = ieee_arithmetic.divide(amax, 6.0)
    # amax / 6 is subnormal below 6 * 2^-126: then amax * 2^149 is an integer n < 2^26, and the
    # quotient's bits are n / 6 rounded to nearest even
    exponent = amax_bits >> bits.MANTISSA_BITS
    significand = (amax_bits & bits.MANTISSA_MASK) | bits.where(exponent > 0, 1 << 23, 0)
    n = significand << bits.clip(exponent - 1, 0, 2)
    q, rest = n // 6, n % 6
    q = q + ((rest > 3) | ((rest == 3) & (q % 2 == 1))).astype(jnp.int32)
    sixth = bits.where(amax < 6.0 * 2.0**-126, bits.from_bits(q), sixth)
    # sixth / g, both scaled by 2^64 where sixth is subnormal (the quotient is unchanged)
    boost = bits.where(exponent <= 3, _BOOST, 0)  # covers every subnormal sixth
    return ieee_arithmetic.divide(exponents.scale_by_pow2(sixth, boost), g * exponents.pow2(boost))
