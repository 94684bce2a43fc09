"""Quantize against kept scales: ``requantize(x, like)`` encodes ``x`` in ``like``'s format and
layout with ``like``'s own block scales (and NVFP4 tensor scale), so that decoded weights that
did not change give back their codes and scales exactly, where deriving the scales again from
the decoded values can give a different scale (an MX ``rceil`` block whose decoded maximum is at
most half the element maximum times its scale gets half that scale back).

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.full((1, 32), 230.0), "mxfp8_e4m3")   # rceil: scale 1
    >>> jaxmx.dequantize(q)[0, 0].item()                            # 230 rounds to 224
    224.0
    >>> fresh = jaxmx.quantize(jaxmx.dequantize(q), "mxfp8_e4m3")   # 224 / 448: scale 1/2
    >>> kept = jaxmx.requantize(jaxmx.dequantize(q), q)
    >>> [r.scale[0, 0].item() for r in (q, fresh, kept)]
    [1.0, 0.5, 1.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmx._src.core import bits
from jaxmx._src.core.blocks import blocked, blocked_shape, tiles, untile
from jaxmx._src.core.dtypes import as_float_array
from jaxmx._src.core.mxarray import MXArray, checked
from jaxmx._src.core.support import lacks
from jaxmx._src.quantize.codec import encode
from jaxmx._src.quantize.quantize import quantize
from jaxmx._src.quantize.scales import rule_of

OUTGROWN = ("rescale", "raise")
"""What :func:`requantize` does with a block whose new values its kept scale cannot hold:
``"rescale"`` gives it the scale the format's rule derives from its values (the other blocks
keep theirs); ``"raise"`` raises a ValueError counting them (needs concrete values)."""


def requantize(
    x: jax.Array, like: MXArray, *, scale_mode: str | None = None, outgrown: str = "rescale"
) -> MXArray:
    """``x`` quantized in ``like``'s format, block axis and tiles with ``like``'s scales.

    Each block is encoded against its kept scale (round to nearest even, as :func:`quantize`
    rounds) when the scale still holds its values: ``|x| / scale`` at most the element maximum
    (give or take a rounding error well below half a code step). Blocks of values that did not
    change since ``like`` was decoded always qualify, so ``requantize(dequantize(q), q)`` is
    ``q``, byte for byte. The NVFP4 tensor scale is always kept.

    Args:
        x: float32, bfloat16 or float16 values of ``like``'s logical shape.
        like: the MXArray whose scales to keep (a format with one scale per block or tile).
        scale_mode: the rule of a block that outgrew its scale (:func:`quantize`'s); ``None``,
            the format's default.
        outgrown: one of :data:`OUTGROWN`.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> q = jaxmx.quantize(jnp.arange(64.0).reshape(2, 32), "mxfp4")
        >>> grown = jaxmx.dequantize(q).at[1, 0].set(1e3)   # row 1 outgrows its scale
        >>> r = jaxmx.requantize(grown, q)
        >>> bool((r.scale[0] == q.scale[0]).all()), bool((r.scale[1] == q.scale[1]).all())
        (True, False)
    """
    like = checked(like, "requantize")
    f = like.format
    if missing := lacks(f, "requantize"):
        raise ValueError(f"requantize: {f.name} has {missing}; requantize keeps block scales")
    if outgrown not in OUTGROWN:
        raise ValueError(f"requantize: outgrown must be one of {OUTGROWN}, got {outgrown!r}")
    x = as_float_array(x, "requantize: x")
    if tuple(x.shape) != like.shape:
        raise ValueError(f"requantize: x has shape {tuple(x.shape)}, like has {like.shape}")
    fresh = quantize(
        x, f.name, like.axis, scale_mode, tile=like.tile, global_scale=like.global_scale
    )
    data, scale, n_outgrown = _requantized(x, like, fresh)
    if outgrown == "raise":
        if isinstance(n_outgrown, jax.core.Tracer):
            raise ValueError("requantize: outgrown='raise' needs concrete values (not under jit)")
        if int(n_outgrown):
            raise ValueError(f"requantize: {int(n_outgrown)} blocks outgrew their kept scales")
    return MXArray(data, scale, f.name, like.axis, like.shape, like.tile, like.global_scale)


@jax.jit
def _requantized(x: jax.Array, like: MXArray, fresh: MXArray):
    """``(codes, scales, number of blocks that took fresh scales)``, all in the block view
    ``[outer, n_blocks, block, inner]`` (tiles: ``[outer, n_tiles, rows * cols, 1]``) until the
    end."""
    f = like.format
    if like.tile is None:
        xb = blocked(x, like.axis, f.block)

        def as_blocks(a, block):
            return a.reshape(blocked_shape(a.shape, like.axis, block))

        def back(a, shape):
            return a.reshape(shape)
    else:
        xb = bits.upcast_exact(tiles(x, like.tile))

        def as_blocks(a, block):
            return tiles(a, like.tile) if block > 1 else a.reshape(*xb.shape[:2], 1, 1)

        def back(a, shape):
            return untile(a, shape, like.tile) if a.shape[2] > 1 else a.reshape(shape)

    rule = rule_of(f)
    kept_scale = as_blocks(like.scale, 1)
    units = rule.units(xb, kept_scale, like.global_scale)
    limit = f.elem_max * (1 + 2.0 ** -(f.mbits + 3))  # below half a code step above elem_max
    fits = jnp.all(jnp.abs(units) <= limit, axis=2, keepdims=True)  # NaN: False
    kept = encode(jnp.clip(units, -f.elem_max, f.elem_max), f)
    codes = jnp.where(fits, kept, as_blocks(fresh.data, f.block))
    scale = jnp.where(fits, kept_scale, as_blocks(fresh.scale, 1))
    return back(codes, like.data.shape), back(scale, like.scale.shape), jnp.sum(~fits)
