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
import operator

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core import bits
from jaxmx._src.core.block_sharding import ReducedAxis, check_block_alignment
from jaxmx._src.core.dtypes import check_float_dtype
from jaxmx._src.core.formats import Format, check_scale_mode, get_format
from jaxmx._src.core.mxarray import (
    MXArray,
    check_tile,
    checked,
    padded_shape,
    scale_shape,
    swap_last_axes,
)
from jaxmx._src.core.swizzle import swizzle_scales
from jaxmx._src.quantize import nvfp4


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
        fmt: ``"mxfp8_e4m3"`` (default), ``"mxfp8_e5m2"``, ``"mxfp4"``, ``"fp8_e4m3_block"``,
            ``"fp8_e5m2_block"`` or ``"nvfp4"``.
        axis: the block axis; padded with zeros to a multiple of the block when needed.
        scale_mode: the scale rule; ``None`` takes the format's default. MX formats:
            ``"rceil"`` (default), ``"floor"``, ``"ceil"`` or ``"even"`` (see
            :data:`jaxmx.SCALE_MODES`); block FP8: ``"fp32"`` (default) or ``"pow2"`` (see
            :data:`jaxmx.BLOCK_SCALE_MODES`); NVFP4: ``"e4m3"``, its only rule.
        key: a PRNG key to round elements stochastically (unbiased); ``None`` rounds to nearest
            even.
        tile: ``(rows, cols)``: one scale per tile of the last two axes instead of per block
            along ``axis`` (which must then be the last axis); both axes are zero-padded to whole
            tiles. The transpose quantized with ``tile[::-1]`` holds the same bytes.
        impl: ``"auto"`` (default: XLA, until the Pallas kernels are measured on a GPU),
            ``"xla"`` or ``"pallas"`` (compiled on a GPU, interpreted on the CPU); the same bytes
            either way (``"pallas"`` takes tiles whose sides divide 128).
        global_scale: NVFP4 only: the float32 per-tensor scale ``g`` to use (at least
            ``2^-126``); ``None`` (default) computes ``amax(|x|) / (448 * 6)``.

    Returns:
        An :class:`MXArray`. MX formats: a block that holds a NaN or an infinity gets the NaN
        scale (0xFF) and dequantizes to NaN; an all-zero block gets the smallest scale (byte 0)
        and zero elements. Block FP8: scales are float32, NaN for a block holding NaN or inf, 1
        for an all-zero block; elements are ``x / s`` rounded to nearest even, saturating.
        NVFP4: E4M3 block scales and ``global_scale`` ``g`` as
        :mod:`jaxmx._src.quantize.nvfp4` defines them (a value is ``code * scale * g``); a block
        (or tensor) holding NaN or inf dequantizes to NaN.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> q = jaxmx.quantize(jnp.full((40,), 480.0), "mxfp8_e4m3")
        >>> q.data.shape, q.scale.shape                  # 40 padded to 64: two blocks
        ((64,), (2,))
        >>> jaxmx.dequantize(q)[:2].tolist()             # rceil: 480 = 240 * 2^1, no saturation
        [480.0, 480.0]
    """
    x, f, axis, scale_mode, key = checked_arguments(x, fmt, axis, scale_mode, key)
    tile = _checked_tile(tile, x.ndim, axis)
    global_scale = nvfp4.checked_global_scale(global_scale, f)
    if check_impl(impl) == "pallas" and tile is not None:
        _check_pallas_tile(tile)
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
    padded = padded_shape(x.shape, axis, f.block, tile)

    def shaped(data, scale, g=None):
        return data.reshape(padded), scale.reshape(scale_shape(x.shape, axis, f.block, tile)), g

    def xla(x):
        if tile is None:
            xb = blocked(x, axis, f.block)  # [outer, n_blocks, block, inner], float32
        else:
            xb = tiles(bits.upcast_exact(x), tile)  # [outer, n_tiles, rows * cols, 1]
        noise = uniform_noise(key, xb.shape)
        if f.has_global_scale:
            data, scale, g = nvfp4.quantize_blocks(xb, f, global_scale, rounding(f, noise))
        else:
            (data, scale), g = _quantize_blocks(xb, f, scale_mode, noise), None
        return shaped(untile(data, padded, tile) if tile else data, scale, g)

    def pallas(x, interpret):
        from jaxmx._src.quantize import pallas as pallas_quantize  # it builds on this module

        args = (f, axis, scale_mode, key, tile, global_scale)
        return shaped(*pallas_quantize.quantize(x, *args, interpret=interpret))

    return dispatch(impl, xla, pallas, x)


def rounding(f: Format, noise):
    """The rounding of scaled elements before clipping: stochastic with ``noise``, else none
    (the encoder rounds to nearest even)."""
    if noise is None:
        return lambda values: values
    return lambda values: _round_stochastically(values, f, noise)


def _checked_tile(tile, ndim: int, axis: int) -> tuple[int, int] | None:
    tile = check_tile(tile, ndim, "quantize")
    if tile is not None and axis != ndim - 1:
        raise ValueError(
            f"quantize: with tile, axis must be the last axis ({ndim - 1}), got {axis}"
        )
    return tile


def _check_pallas_tile(tile: tuple[int, int]) -> None:
    """A ValueError for a tile the Pallas kernels do not cover: a side that does not divide
    their 128 x 128 tile."""
    from jaxmx._src.quantize.pallas import TILE  # it builds on this module

    if any(TILE % n for n in tile):
        raise ValueError(
            f"impl='pallas' covers tiles whose sides divide {TILE}, not {tile}; use impl='xla'"
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
        axis = q.data_axis
        outer = math.prod(q.data.shape[:axis])
        inner = math.prod(q.data.shape[axis + 1 :])
        values = values.reshape(outer, q.scale.shape[axis], f.block, inner)
        scale = q.scale.reshape(outer, q.scale.shape[axis], 1, inner)
    else:
        values = tiles(values, q.tile)
        scale = q.scale.reshape(values.shape[0], values.shape[1], 1, 1)
    out = _scaled(values, scale, q)
    out = untile(out, q.data.shape, q.tile) if q.tile else out.reshape(q.data.shape)
    out = _times_global_scale(out, q)
    for i, n in enumerate(q.shape[-2:] if q.tile else (q.shape[q.axis],)):
        axis = out.ndim - 2 + i if q.tile else q.data_axis
        out = lax.slice_in_dim(out, 0, n, axis=axis)
    return out.astype(dtype)


def _scaled(values, scale, q: MXArray) -> jax.Array:
    """Decoded elements times their block scales (for NVFP4, not yet its tensor scale)."""
    if q.format.is_mx:  # exact, subnormal results included
        return scale_back(values, scale_exponent_bytes(scale))
    if q.format.has_global_scale:  # code * s: exact
        return values * nvfp4.block_scales(scale)
    return values * scale  # block FP8: a float32 product


def _times_global_scale(out: jax.Array, q: MXArray) -> jax.Array:
    """NVFP4: ``out`` (codes times block scales, shaped like ``q.data``) times the tensor scale,
    rounded as IEEE float32 (one scale per leading vmap dimension)."""
    if not q.format.has_global_scale:
        return out
    g = q.global_scale
    return bits.multiply_exact(out, g.reshape(g.shape + (1,) * (out.ndim - g.ndim)))


def scale_back(values: jax.Array, byte: jax.Array) -> jax.Array:
    """``values * 2^(byte - 127)`` exactly (subnormals included), NaN where ``byte`` is 0xFF."""
    k = jnp.minimum(byte, 254) - bits.EXPONENT_BIAS
    return jnp.where(byte == bits.E8M0_NAN, jnp.nan, bits.ldexp_exact(values, k))


def quantize_rowwise_colwise(
    x: jax.Array,
    fmt: str = "mxfp8_e4m3",
    scale_mode: str | None = None,
    *,
    key: jax.Array | None = None,
    impl: str = "auto",
    swizzled_scales: bool = False,
):
    """Both copies of a 2-D ``x`` [M, K] that a training GEMM needs, from one read of ``x``.

    Args:
        x, fmt, scale_mode, key: as for :func:`quantize`.
        impl: ``"auto"`` (default: XLA, until the Pallas kernels are measured on a GPU),
            ``"xla"`` or ``"pallas"`` (one read of each 128 x 128 tile of ``x`` writes both
            copies; compiled on a GPU, interpreted on the CPU). The same bytes either way.
        swizzled_scales: also return both copies' scales in the cuBLAS 128x4 layout (as
            :func:`jaxmx.swizzle_scales` gives them), written by the same kernel: the E8M0
            bytes of the MX formats, the E4M3 bytes of NVFP4 (block FP8's float32 scales have
            no such layout: a ValueError).

    Returns:
        ``(row, col_t)``: ``row`` is ``x`` quantized along K (axis -1), shape [M, K];
        ``col_t`` is ``x.T`` [K, M] quantized along M (its axis -1), physically transposed.
        With ``swizzled_scales``, ``(row, col_t, row_swizzled, col_t_swizzled)``.
        With ``key``, the two copies round with ``split(key)``'s two keys. NVFP4: both copies
        hold the one tensor scale ``g`` of ``x``.

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
    x = jnp.asarray(x)
    _check_input(x)
    if swizzled_scales and f.scale_dtype == jnp.float32:
        raise ValueError(
            f"swizzled_scales covers the E8M0 (MX) and E4M3 (NVFP4) scales of the cuBLAS 128x4 "
            f"layout, not the float32 scales of {f.name}"
        )
    if x.ndim != 2:
        raise ValueError(f"quantize_rowwise_colwise expects a 2-D array, got shape {x.shape}")
    key = None if key is None else _check_key(key)
    return _rowwise_colwise(
        x, key, f=f, scale_mode=scale_mode, impl=check_impl(impl), swizzled=swizzled_scales
    )


@functools.partial(jax.jit, static_argnames=("f", "scale_mode", "impl", "swizzled"))
def _rowwise_colwise(x, key, *, f: Format, scale_mode: str, impl: str, swizzled: bool):
    """:func:`quantize_rowwise_colwise` of checked arguments, one compiled program per shape."""
    row_key = col_key = None
    if key is not None:
        row_key, col_key = jax.random.split(key)

    def xla(x):
        row = quantize(x, f.name, axis=1, scale_mode=scale_mode, key=row_key, impl="xla")
        col_t = swap_last_axes(
            quantize(x, f.name, axis=0, scale_mode=scale_mode, key=col_key, impl="xla")
        )
        if swizzled:
            return row, col_t, swizzle_scales(row.scale), swizzle_scales(col_t.scale)
        return row, col_t

    def pallas(x, interpret):
        from jaxmx._src.quantize import pallas as pallas_quantize  # it builds on this module

        keys = (row_key, col_key)
        return pallas_quantize.rowwise_colwise(x, f, scale_mode, keys, swizzled, interpret)

    return dispatch(impl, xla, pallas, x)


def decode_elements(data: jax.Array, f: Format) -> jax.Array:
    """float32 values of element codes of format ``f``, exactly."""
    if f.is_fp8:
        code = bits.as_bytes(data)
        return bits.decode_fp8(code, f.mbits, f.emin, ieee_specials=f.has_inf)
    return data.astype(jnp.float32)


def scale_exponent_bytes(scale: jax.Array) -> jax.Array:
    """The E8M0 bytes of ``scale`` as int32 (the scale is ``2^(byte - 127)``, 255 is NaN)."""
    return bits.as_bytes(scale, "MX scales", bits.SCALE_DTYPES).astype(jnp.int32)


IMPLS = ("auto", "xla", "pallas")
"""Quantizer implementations: ``"xla"`` (fused ``jax.numpy``, every backend), ``"pallas"``
(:mod:`jaxmx._src.quantize.pallas`'s kernels: compiled for CUDA GPUs, interpreted on the CPU),
``"auto"`` (XLA on every platform: the kernels have not yet been measured, or run, on a GPU,
so nothing selects them until a GPU shows them faster; see docs/benchmarks.md). ``"pallas"``
is chosen per lowering platform."""


def check_impl(impl) -> str:
    """``impl`` after checking it names an implementation that runs here.

    A ValueError for an unknown ``impl``, and for ``impl="pallas"`` where JAX's default backend
    is neither a GPU nor the CPU (the kernels are written for Triton; interpreting them
    elsewhere is not supported).
    """
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    platform = jax.default_backend()
    if impl == "pallas" and platform not in ("gpu", "cpu"):
        raise ValueError(
            f"impl='pallas' runs on CUDA GPUs (compiled) and on the CPU (interpreted), not on "
            f"{platform!r}; use impl='xla' (or 'auto')"
        )
    return impl


def dispatch(impl: str, xla, pallas, x):
    """``xla(x)`` or ``pallas(x, interpret=...)`` on each lowering platform, as a checked
    ``impl`` (:func:`check_impl`) says."""
    if impl in ("xla", "auto"):
        return xla(x)
    compiled = functools.partial(pallas, interpret=False)
    interpreted = functools.partial(pallas, interpret=True)
    return lax.platform_dependent(x, cuda=compiled, default=interpreted)


# --- internals ------------------------------------------------------------------------------


def checked_arguments(x, fmt: str, axis: int, scale_mode: str | None, key):
    """``(x as an array, its Format, axis made non-negative, the scale mode (the format's
    default for ``None``), key)`` after :func:`quantize`'s checks, each raising an error that
    names the argument at fault."""
    f = get_format(fmt)
    scale_mode = check_scale_mode(scale_mode, f)
    x = jnp.asarray(x)
    _check_input(x)
    axis = normalize_axis(axis, x.ndim)
    check_block_alignment(x, "jaxmx.quantize", "x", (ReducedAxis(axis, f"{axis}"),), f.block)
    if key is not None:
        key = _check_key(key)
    return x, f, axis, scale_mode, key


def _check_input(x: jax.Array) -> None:
    check_float_dtype(x.dtype, "quantize: x's dtype")
    if x.ndim == 0:
        raise ValueError("quantize expects an array of rank >= 1, got a scalar")


def _check_key(key) -> jax.Array:
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return key
    if dtype == jnp.uint32 and key.shape == (2,):
        return key
    shape = getattr(key, "shape", "")
    raise TypeError(
        f"key must be a PRNG key (jax.random.key), got {dtype or type(key).__name__}{shape}"
    )


def normalize_axis(axis: int, ndim: int) -> int:
    try:
        if isinstance(axis, bool):
            raise TypeError
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"axis must be an integer, got {axis!r}") from None
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {ndim}")
    return axis % ndim


def blocked(x: jax.Array, axis: int, block: int) -> jax.Array:
    """float32 view of x as [outer, n_blocks, block, inner], zero-padded along the block axis."""
    x = bits.upcast_exact(x)
    size = x.shape[axis]
    n_blocks = -(-size // block)
    if n_blocks * block != size:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, n_blocks * block - size)
        x = jnp.pad(x, pad)
    outer = math.prod(x.shape[:axis])
    inner = math.prod(x.shape[axis + 1 :])
    return x.reshape(outer, n_blocks, block, inner)


def tiles(x: jax.Array, tile: tuple[int, int]) -> jax.Array:
    """``x [..., R, C]`` zero-padded to whole tiles and viewed as ``[outer, n_tiles, rows * cols,
    1]`` (tiles in row-major order, each tile's elements row-major)."""
    rows, cols = tile
    r, c = x.shape[-2:]
    pad = [(0, 0)] * (x.ndim - 2) + [(0, -r % rows), (0, -c % cols)]
    x = jnp.pad(x, pad) if any(p for _, p in pad) else x
    r, c = x.shape[-2:]
    x = x.reshape(-1, r // rows, rows, c // cols, cols).transpose(0, 1, 3, 2, 4)
    return x.reshape(x.shape[0], (r // rows) * (c // cols), rows * cols, 1)


def untile(t: jax.Array, shape: tuple[int, ...], tile: tuple[int, int]) -> jax.Array:
    """The inverse of :func:`tiles` for a padded ``shape`` (whole tiles)."""
    rows, cols = tile
    r, c = shape[-2:]
    t = t.reshape(-1, r // rows, c // cols, rows, cols).transpose(0, 1, 3, 2, 4)
    return t.reshape(shape)


def uniform_noise(key, shape) -> jax.Array | None:
    """The uniform [0, 1) draws of stochastic rounding for blocked elements of ``shape``
    (:func:`blocked`'s layout), or None without a key."""
    return None if key is None else jax.random.uniform(key, shape, jnp.float32)


def _quantize_blocks(xb, f: Format, scale_mode: str, noise):
    if f.is_mx:
        byte, values = scaled_blocks(xb, f, scale_mode, noise)
        scale = lax.bitcast_convert_type(byte.astype(jnp.uint8), jnp.float8_e8m0fnu)
    else:
        scale, values = float32_scaled_blocks(xb, f, scale_mode, noise)
    return encode(values, f), jnp.squeeze(scale, axis=2)


def scaled_blocks(xb, f: Format, scale_mode: str, noise):
    """(E8M0 bytes [outer, n_blocks, 1, inner] int32, elements divided by their scale and clamped
    to ``±elem_max``) of ``xb`` = :func:`blocked`'s output; with ``noise`` (uniform [0, 1)
    draws shaped like ``xb``, see :func:`uniform_noise`) the elements are rounded stochastically.

    The elements are not yet rounded to the element grid (unless ``noise`` rounded them): the
    quantizer encodes them (round to nearest even), the fake quantizer rounds them in float32.
    """
    x_bits = bits.to_bits(xb)
    magnitude_bits = x_bits & 0x7FFFFFFF  # integer order == float order (NaN above inf)

    def byte_of(amax_bits):
        return bits.scale_bytes(amax_bits, f.emax, _round_up(amax_bits, f, scale_mode))

    if xb.shape[3] == 1:
        # Blocks along the minor axis. The byte is a non-decreasing function of amax's bits in
        # every mode, so the block maximum of the per-element bytes IS the byte of the block's
        # amax. Reducing the bytes makes the reduction output the final per-block value, and the
        # element fusion no longer recomputes the scale rule for each of its elements: ~20%
        # faster on XLA:CPU, identical bytes. (For blocks along another axis it is slower.)
        byte = jnp.max(byte_of(magnitude_bits), axis=2, keepdims=True)
    else:
        byte = byte_of(jnp.max(magnitude_bits, axis=2, keepdims=True))
    exponent = jnp.where(byte == bits.E8M0_NAN, 128, byte - bits.EXPONENT_BIAS)
    scaled = bits.scale_by_pow2(xb, -exponent)
    if noise is not None:
        scaled = _round_stochastically(scaled, f, noise)
    return byte, jnp.clip(scaled, -f.elem_max, f.elem_max)


def float32_scaled_blocks(xb, f: Format, scale_mode: str, noise):
    """Block FP8: (float32 scales [outer, n_blocks, 1, inner] (:data:`jaxmx.BLOCK_SCALE_MODES`),
    elements ``x / s`` clipped to ``±elem_max``), as :func:`scaled_blocks` for the MX formats:
    the codes are ``encode(x / s)``."""
    amax_bits = jnp.max(bits.to_bits(xb) & 0x7FFFFFFF, axis=2, keepdims=True)
    amax = bits.from_bits(amax_bits)
    if scale_mode == "fp32":
        scale = jnp.maximum(bits.divide(amax, f.elem_max), jnp.float32(2.0**-126))
    else:  # pow2: the rceil exponent, k >= -127, exact
        byte = bits.scale_bytes(amax_bits, f.emax, _round_up(amax_bits, f, "rceil"))
        scale = bits.ldexp_exact(jnp.ones_like(amax), byte - bits.EXPONENT_BIAS)
    exponent = amax_bits >> bits.MANTISSA_BITS
    # zero tested field by field: XLA:CPU may turn `bits == 0` into a float compare, which
    # treats a subnormal amax as zero
    all_zero = (exponent == 0) & ((amax_bits & bits.MANTISSA_MASK) == 0)
    scale = jnp.where(exponent == 0xFF, jnp.nan, jnp.where(all_zero, 1.0, scale))
    # x / s as the quotient of normal floats: both scaled by 2^64 where s is tiny, so no
    # subnormal operand meets a flushing division (the quotient is unchanged)
    boost = jnp.where(scale < 2.0**-60, 64, 0)
    scaled = bits.divide(bits.scale_by_pow2(xb, boost), bits.scale_by_pow2(scale, boost))
    if noise is not None:
        scaled = _round_stochastically(scaled, f, noise)
    return scale, jnp.clip(scaled, -f.elem_max, f.elem_max)


def _round_up(amax_bits, f: Format, scale_mode: str):
    """Whether the block exponent is one above floor(log2(amax)) - emax, per scale mode."""
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


def _round_stochastically(scaled, f: Format, noise):
    """Rounds ``scaled`` to the element grid up or down with probability by distance."""
    magnitude = jnp.abs(scaled)
    exponent = (bits.to_bits(magnitude) >> bits.MANTISSA_BITS) - bits.EXPONENT_BIAS
    quantum_exp = jnp.maximum(exponent, f.emin) - f.mbits
    units = magnitude * bits.pow2(-quantum_exp)  # exact: < 2^(mbits + 1)
    whole = jnp.floor(units)
    # up with probability frac(units); not floor(units + noise), whose float32 sum can round up
    # to the next integer and move an exactly representable value (p ~ 2^-21)
    up = (noise < units - whole).astype(jnp.float32)  # units - whole is exact
    rounded = (whole + up) * bits.pow2(quantum_exp)
    return jnp.where(jnp.isfinite(scaled), jnp.copysign(rounded, scaled), scaled)


def encode(values: jax.Array, f: Format, on_grid: bool = False) -> jax.Array:
    """RNE cast of in-range float32 values to the element dtype (``on_grid``: the values are
    already on the element grid, see :func:`jaxmx._src.core.bits.round_to_grid`)."""
    if f.is_fp8:
        code = bits.encode_fp8(values, f.mbits, f.emin, on_grid)
        return lax.bitcast_convert_type(code, f.dtype)
    return values.astype(f.dtype)
