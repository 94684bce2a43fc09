"""Quantize to and dequantize from block-scaled formats: the OCP MX formats (bit-exact to the
spec and to cuBLAS's rceil) and block FP8 (DeepSeek-V3's 1x128 / 128x128 float32-scaled tiles).

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> x = jnp.linspace(-3.0, 3.0, 64).reshape(2, 32)
    >>> q = jaxmx.quantize(x, "mxfp8_e4m3")            # blocks of 32 along the last axis
    >>> q.scale.view(jnp.uint8).tolist()               # 2^-7: 3 / 2^-7 = 384 <= 448
    [[120], [120]]
    >>> bool(jnp.abs(jaxmx.dequantize(q) - x).max() <= 3 * 2.0**-4)
    True
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core import bits
from jaxmx._src.core.block_sharding import ReducedAxis, check_block_alignment
from jaxmx._src.core.blocks import (
    block_of,
    blocked,
    blocked_shape,
    format_scale_shape,
    padded_shape,
    tile_view,
    untile,
)
from jaxmx._src.core.checks import check_key, normalize_axis
from jaxmx._src.core.copies import Copies, SwizzledCopies, as_copies
from jaxmx._src.core.dtypes import as_float_array, check_float_dtype
from jaxmx._src.core.explicit_axes import on_explicit_axes
from jaxmx._src.core.formats import Format, check_scale_mode, get_format
from jaxmx._src.core.materialize import materialized
from jaxmx._src.core.mxarray import MXArray, check_tile, checked
from jaxmx._src.core.mxarray_layouts import swap_last_axes
from jaxmx._src.core.support import lacks
from jaxmx._src.core.swizzle import swizzle_scales
from jaxmx._src.quantize import nvfp4, pallas
from jaxmx._src.quantize.codec import decode_elements, encode
from jaxmx._src.quantize.impl import check_impl, check_pallas_tile, dispatch
from jaxmx._src.quantize.rounding import uniform_noise
from jaxmx._src.quantize.scales import rule_of


def quantize(
    x: jax.Array,
    fmt: str = "mxfp8_e4m3",
    axis: int = -1,
    scale_mode: str | None = None,
    *,
    key: jax.Array | None = None,
    tile: tuple[int, int] | None = None,
    impl: str = "auto",
    global_scale: jax.Array | None = None,
) -> MXArray:
    """Quantizes ``x`` in blocks of consecutive elements along ``axis`` (32 for the MX formats,
    128 for block FP8, 16 for NVFP4), or in 2-D tiles of its last two axes.

    Args:
        x: a float32, bfloat16 or float16 array of any rank >= 1.
        fmt: ``"mxfp8_e4m3"`` (default), ``"mxfp8_e5m2"``, ``"mxfp4"``, ``"mxfp6_e2m3"``,
            ``"mxfp6_e3m2"``, ``"mxint8"``, ``"fp8_e4m3_block"``, ``"fp8_e5m2_block"``,
            ``"nvfp4"``, or the FP8 formats with one float32 scale per tensor
            (``"fp8_e4m3_tensor"``, ``"fp8_e5m2_tensor"``) or per row along ``axis``
            (``"fp8_e4m3_row"``, ``"fp8_e5m2_row"``) (``jaxmx.FORMATS``; FP6 codes come in
            ``uint8``, MXINT8 codes in ``int8``, the value being ``code * 2^-6``).
        axis: the block axis; padded with zeros to a multiple of the block when needed. For
            per-row formats a scale covers the whole axis (one per index of the other axes).
        scale_mode: the scale rule; ``None`` takes the format's default. MX formats:
            ``"rceil"`` (default), ``"floor"``, ``"ceil"`` or ``"even"`` (see
            :data:`jaxmx.SCALE_MODES`); block FP8: ``"fp32"`` (default) or ``"pow2"`` (see
            :data:`jaxmx.BLOCK_SCALE_MODES`); NVFP4: ``"e4m3"``, its only rule; per-tensor and
            per-row FP8: ``"fp32"`` (default) or ``"pow2"`` (see
            :data:`jaxmx.CURRENT_SCALE_MODES`).
        key: a PRNG key to round elements stochastically (unbiased); ``None`` rounds to nearest
            even.
        tile: ``(rows, cols)``: one scale per tile of the last two axes instead of per block
            along ``axis`` (which must then be the last axis); both axes are zero-padded to whole
            tiles. The transpose quantized with ``tile[::-1]`` holds the same bytes.
        impl: ``"auto"`` (default: XLA), ``"xla"`` or ``"pallas"`` (the Pallas kernels,
            interpreted on the CPU, refused on GPUs); the same bytes either way (``"pallas"``
            takes tiles whose sides divide 128).
        global_scale: NVFP4 only: the float32 per-tensor scale ``g`` to use (at least
            ``2^-126``); ``None`` (default) computes ``amax(|x|) / (448 * 6)``.

    Returns:
        An :class:`MXArray`. MX formats: a block that holds a NaN or an infinity gets the NaN
        scale (0xFF) and dequantizes to NaN; an all-zero block gets the smallest scale (byte 0)
        and zero elements. Block FP8: scales are float32, NaN for a block holding NaN or inf, 1
        for an all-zero block; elements are ``x / s`` rounded to nearest even, saturating.
        NVFP4: E4M3 block scales and ``global_scale`` ``g`` as
        :mod:`jaxmx._src.quantize.nvfp4` defines them (a value is ``code * scale * g``); a block
        (or tensor) holding NaN or inf dequantizes to NaN. Per-tensor and per-row FP8: float32
        scales that multiply (codes ``x * scale``, values ``code / scale``), shaped all ones
        (per tensor) or like ``x`` with ``axis`` of size 1 (per row); NaN for a tensor or row
        holding NaN or inf, ``elem_max / 1e-12`` for an all-zero one.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> q = jaxmx.quantize(jnp.full((40,), 480.0), "mxfp8_e4m3")
        >>> q.data.shape, q.scale.shape                  # 40 padded to 64: two blocks
        ((64,), (2,))
        >>> jaxmx.dequantize(q)[:2].tolist()             # rceil: 480 = 240 * 2^1, no saturation
        [480.0, 480.0]
    """
    x, f, axis, scale_mode, key = checked_arguments(x, fmt, axis, scale_mode, key)
    tile = _checked_tile(tile, x.ndim, axis, f)
    global_scale = nvfp4.checked_global_scale(global_scale, f)
    if check_impl(impl) == "pallas":
        _check_pallas_format(f, "quantize")
        if tile is not None:
            check_pallas_tile(tile)
    data, scale, g = _codes_and_scales(
        x, key, global_scale, f=f, axis=axis, scale_mode=scale_mode, tile=tile, impl=impl
    )
    return MXArray(
        data=data,
        scale=scale,
        fmt=f.name,
        axis=axis,
        shape=tuple(x.shape),
        tile=tile,
        global_scale=g,
    )


@functools.partial(jax.jit, static_argnames=("f", "axis", "scale_mode", "tile", "impl"))
def _codes_and_scales(x, key, global_scale, *, f: Format, axis: int, scale_mode, tile, impl: str):
    """``(codes, scales, NVFP4's tensor scale or None)`` of checked arguments: one compiled
    program per shape and static setting, so that an eager call compiles once, not per op."""
    block = block_of(f, x.shape, axis)
    padded = padded_shape(x.shape, axis, block, tile)

    def shaped(data, scale, g=None):
        return data.reshape(padded), scale.reshape(format_scale_shape(f, x.shape, axis, tile)), g

    def xla(x):
        if tile is None:
            xb = blocked(x, axis, block)  # [outer, n_blocks, block, inner], float32
            noise, block_axes = uniform_noise(key, xb.shape, tied_to=x), (2,)
        else:  # tiles in their place, [outer, R, rows, C, cols]: no transposed copy of x
            xb = bits.upcast_exact(tile_view(x, tile))
            noise, block_axes = _tile_noise(key, padded, tile, x), (2, 4)
        rule = rule_of(f)
        codes, values, g = rule.scaled(xb, f, scale_mode, noise, global_scale, block_axes)
        data, scales = encode(values, f), rule.scales(codes)
        if tile is not None and f.storage_bits == 8:  # one copy serves two GEMMs: held as codes
            data = materialized(data, one_from=scales)
        return shaped(data, scales, g)

    def kernels(x):
        settings = dict(f=f, axis=axis, scale_mode=scale_mode, key=key, tile=tile)
        return shaped(*pallas.quantize(x, **settings, g=global_scale))

    return dispatch(impl, xla, kernels, x)


def _tile_noise(key, padded: tuple[int, ...], tile: tuple[int, int], x) -> jax.Array | None:
    """Stochastic rounding's draws for tiles of ``x`` in their place (:func:`tile_view` of the
    ``padded`` shape), drawn in whole-tile order (:func:`tiles`'s layout, as the Pallas kernels
    draw them) and laid out in place."""
    if key is None:
        return None
    rows, cols = tile
    n_tiles = padded[-2] // rows * (padded[-1] // cols)
    draws = uniform_noise(key, (math.prod(padded[:-2]), n_tiles, rows * cols, 1), tied_to=x)
    return tile_view(untile(draws, padded, tile), tile)


def _checked_tile(tile, ndim: int, axis: int, f: Format) -> tuple[int, int] | None:
    tile = check_tile(tile, ndim, "quantize")
    if tile is not None and (missing := lacks(f, "tiles")):
        raise ValueError(
            f"quantize: {f.name} has {missing}; tile= (one scale per 2-D tile) does not apply to it"
        )
    if tile is not None and axis != ndim - 1:
        raise ValueError(
            f"quantize: with tile, axis must be the last axis ({ndim - 1}), got {axis}"
        )
    return tile


def _check_pallas_format(f: Format, where: str) -> None:
    """The Pallas kernels cover formats in blocks and tiles, not per-tensor or per-row scales,
    nor codes wider than a byte (E5M6): :data:`~jaxmx._src.core.support.FEATURES`."""
    if missing := lacks(f, "pallas"):
        raise NotImplementedError(
            f"{where}: impl='pallas' has no kernel for {f.name} ({missing}); use impl='xla' or "
            "'auto'"
        )


def dequantize(q: MXArray, dtype=jnp.float32) -> jax.Array:
    """Decodes ``q`` to ``dtype``, exactly (values are exact in float32, subnormals included).

    Args:
        q: an :class:`MXArray` (checked for consistency first).
        dtype: float32 (default), bfloat16 or float16.

    Returns an array of the logical (unpadded) shape. Blocks with the NaN scale become NaN.

    Gradients: ``dequantize(quantize(x))`` is piecewise constant in ``x``, and JAX differentiates
    it as such: its gradient is zero (quantize works on integer codes). To train through MX
    quantization use :func:`jaxmx.dot_general`, whose custom VJP quantizes each GEMM's operands.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> x = jnp.array([1.0, -0.5, 0.25] + [0.0] * 29)
        >>> jaxmx.dequantize(jaxmx.quantize(x))[:3].tolist()
        [1.0, -0.5, 0.25]
    """
    q = checked(q, "dequantize")
    return _dequantized(q, dtype=check_float_dtype(dtype, "dequantize: dtype"))


@functools.partial(jax.jit, static_argnames="dtype")
def _dequantized(q: MXArray, *, dtype) -> jax.Array:
    """:func:`dequantize` of a checked ``q``, one compiled program per shape and format."""
    f = q.format
    # XLA's constant folder mis-evaluates the bit manipulation below on transposed float8
    # constants (e.g. quantized jit-captured arrays): the barrier keeps it out of folding.
    q = lax.optimization_barrier(q)
    values = decode_elements(q.data, f)
    if q.tile is None:
        block = block_of(f, q.data.shape, q.data_axis)
        values = values.reshape(blocked_shape(q.data.shape, q.data_axis, block))
        scale = _scales_per_block(q)
        scale = scale.reshape(blocked_shape(scale.shape, q.data_axis, 1))
    else:  # each element times its tile's scale in place (no transpose to whole tiles)
        values = tile_view(values, q.tile)
        scale = q.scale.reshape(values.shape[0], values.shape[1], 1, values.shape[3], 1)
    rule = rule_of(f)
    out = rule.decoded(values, scale).reshape(q.data.shape)  # times the block scales
    out = rule.with_tensor_scale(out, q.global_scale)
    for i, n in enumerate(q.shape[-2:] if q.tile else (q.shape[q.axis],)):
        axis = out.ndim - 2 + i if q.tile else q.data_axis
        out = lax.slice_in_dim(out, 0, n, axis=axis)
    return out.astype(dtype)


def _scales_per_block(q: MXArray) -> jax.Array:
    """``q``'s 1-D block scales shaped like its codes with the block axis divided by the block
    (a tensor scale broadcast over the other axes, leading batch dims kept)."""
    if q.format.span != "tensor":
        return q.scale
    shape = list(q.data.shape)
    shape[q.data_axis] = 1
    return jnp.broadcast_to(q.scale, shape)


def quantize_rowwise_colwise(
    x: jax.Array,
    fmt: str = "mxfp8_e4m3",
    scale_mode: str | None = None,
    *,
    key: jax.Array | None = None,
    impl: str = "auto",
    swizzled_scales: bool = False,
) -> Copies | SwizzledCopies:
    """Both copies of a 2-D ``x`` [M, K] that a training GEMM needs, from one read of ``x``.

    Args:
        x, fmt, scale_mode, key: as for :func:`quantize`.
        impl: ``"auto"`` (default: XLA), ``"xla"`` or ``"pallas"`` (one read of each 128 x 128
            tile of ``x`` writes both copies; interpreted on the CPU, refused on GPUs). The same
            bytes either way.
        swizzled_scales: also return both copies' scales in the cuBLAS 128x4 layout (as
            :func:`jaxmx.swizzle_scales` gives them), written by the same kernel: the E8M0
            bytes of the MX formats, the E4M3 bytes of NVFP4 (block FP8's float32 scales have
            no such layout: a ValueError).

    Returns:
        :class:`jaxmx.Copies` ``(row, col_t)``: ``row`` is ``x`` quantized along K (axis -1),
        shape [M, K]; ``col_t`` is ``x.T`` [K, M] quantized along M (its axis -1), physically
        transposed. With ``swizzled_scales``, :class:`jaxmx.SwizzledCopies`
        ``(row, col_t, row_swizzled, col_t_swizzled)``.
        With ``key``, the two copies round with ``split(key)``'s two keys. NVFP4: both copies
        hold the one tensor scale ``g`` of ``x``. Per-tensor FP8 (``fp8_e4m3_tensor``...): one
        quantization (rounded with the first key), ``col_t`` its codes transposed; per-row FP8:
        two, one scale per row of ``x`` and one per column.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> row, col_t = jaxmx.quantize_rowwise_colwise(jnp.ones((64, 96)))
        >>> row.scale.shape, col_t.scale.shape
        ((64, 3), (96, 2))
        >>> *_, row_sw, col_sw = jaxmx.quantize_rowwise_colwise(jnp.ones((64, 96)),
        ...                                                   swizzled_scales=True)
        >>> row_sw.shape, col_sw.shape                     # 128 x 4 and 128 x 4 padded tiles
        ((512,), (512,))
    """
    f = get_format(fmt)
    scale_mode = check_scale_mode(scale_mode, f)
    x = as_float_array(x, "quantize_rowwise_colwise: x")
    _check_input(x)
    if swizzled_scales and f.scale_dtype == jnp.float32:
        raise ValueError(
            f"swizzled_scales covers the E8M0 (MX) and E4M3 (NVFP4) scales of the cuBLAS 128x4 "
            f"layout, not the float32 scales of {f.name}"
        )
    if x.ndim != 2:
        raise ValueError(f"quantize_rowwise_colwise expects a 2-D array, got shape {x.shape}")
    key = None if key is None else check_key(key, "quantize_rowwise_colwise")
    if check_impl(impl) == "pallas":
        _check_pallas_format(f, "quantize_rowwise_colwise")
    return as_copies(
        on_explicit_axes(
            _rowwise_colwise,
            x,
            key,
            f=f,
            scale_mode=scale_mode,
            impl=check_impl(impl),
            swizzled=swizzled_scales,
        )
    )


@functools.partial(jax.jit, static_argnames=("f", "scale_mode", "impl", "swizzled"))
def _rowwise_colwise(x, key, *, f: Format, scale_mode: str, impl: str, swizzled: bool):
    """:func:`quantize_rowwise_colwise` of checked arguments, one compiled program per shape."""
    row_key = col_key = None
    if key is not None:
        row_key, col_key = jax.random.split(key)

    def xla(x):
        row = quantize(x, f.name, axis=1, scale_mode=scale_mode, key=row_key, impl="xla")
        if f.span == "tensor":  # one quantization: the tensor scale does not depend on the axis
            col_t = swap_last_axes(row)
        else:
            col_t = swap_last_axes(
                quantize(x, f.name, axis=0, scale_mode=scale_mode, key=col_key, impl="xla")
            )
        if swizzled:
            return row, col_t, swizzle_scales(row.scale), swizzle_scales(col_t.scale)
        return row, col_t

    def kernels(x):
        return pallas.rowwise_colwise(
            x, f=f, scale_mode=scale_mode, copy_keys=(row_key, col_key), swizzled=swizzled
        )

    return dispatch(impl, xla, kernels, x)


def checked_arguments(x, fmt: str, axis: int, scale_mode: str | None, key):
    """``(x as an array, its Format, axis made non-negative, the scale mode (the format's
    default for ``None``), key)`` after :func:`quantize`'s checks, each raising an error that
    names the argument at fault."""
    f = get_format(fmt)
    scale_mode = check_scale_mode(scale_mode, f)
    x = as_float_array(x, "quantize: x")
    _check_input(x)
    axis = normalize_axis(axis, x.ndim)
    check_block_alignment(x, "jaxmx.quantize", "x", (ReducedAxis(axis, f"{axis}"),), f.block)
    if key is not None:
        key = check_key(key, "quantize")
    return x, f, axis, scale_mode, key


def _check_input(x: jax.Array) -> None:
    check_float_dtype(x.dtype, "quantize: x's dtype")
    if x.ndim == 0:
        raise ValueError("quantize expects an array of rank >= 1, got a scalar")
