"""The quantizers as Pallas kernels: one read of the input per tile, both copies from it.

``quantize(..., impl="pallas")`` and ``quantize_rowwise_colwise(..., impl="pallas")`` run these
kernels for every format (MX, block FP8, NVFP4), 1-D blocks along any axis and 2-D tiles whose
sides divide 128; they give the same bytes as the XLA quantizers (``impl="xla"``): the per-tile
arithmetic is the XLA quantizer's own (:func:`jaxmx._src.quantize.scales.scaled_blocks`,
:func:`~jaxmx._src.quantize.scales.float32_scaled_blocks`,
:func:`jaxmx._src.quantize.nvfp4.scaled_blocks`,
then the element encoding), applied to a VMEM/SRAM tile instead of the whole array. NVFP4's
tensor scale ``g`` is a reduction over all of ``x``: it is computed before the kernel (as the
XLA quantizer computes it) and read by every tile.

The fused kernel reads a 128 x 128 tile of ``x`` [M, K] once and writes the rowwise copy's codes
and scales, the columnwise copy's codes and scales physically transposed ([K, M]), and, on
request, both scale matrices in the cuBLAS 128x4 swizzled layout (each tile owns one contiguous
chunk of each: 512 bytes for the MX formats' 4 blocks per tile row, 1024 for NVFP4's 8).
Stochastic rounding reads the uniform draws that the XLA quantizer draws from the same key (so
that the bytes agree), one more input per copy.

``impl="pallas"`` runs them in Pallas interpret mode (slow: for tests); compiled by Pallas'
Triton lowering for a GPU they gave other bytes, and are refused there
(:data:`~jaxmx._src.quantize.impl.PALLAS_ON_GPU`). Inputs are zero-padded to whole tiles
(padding never changes a scale) and the outputs sliced back.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> x = jnp.linspace(-3.0, 3.0, 64 * 96).reshape(64, 96)
    >>> row, col_t = jaxmx.quantize_rowwise_colwise(x, impl="pallas")   # interpreted on a CPU
    >>> ref_row, ref_col_t = jaxmx.quantize_rowwise_colwise(x, impl="xla")
    >>> bool((row.data == ref_row.data).all() and (col_t.scale == ref_col_t.scale).all())
    True
    >>> q = jaxmx.quantize(x, "nvfp4", tile=(16, 16), impl="pallas")
    >>> q.scale.shape, bool(q.global_scale == jaxmx.quantize(x, "nvfp4", impl="xla").global_scale)
    ((4, 6), True)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxmx._src.core import bits, wire
from jaxmx._src.core.blocks import tiles, untile
from jaxmx._src.core.formats import Format
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.reductions import in_one_step
from jaxmx._src.core.sizes import ceil_div
from jaxmx._src.core.swizzle import COL_TILE, ROW_TILE
from jaxmx._src.core.vma import vary_like
from jaxmx._src.quantize.codec import codec_of, to_grid
from jaxmx._src.quantize.impl import PALLAS_TILE as TILE
from jaxmx._src.quantize.rounding import uniform_noise
from jaxmx._src.quantize.scales import rule_of

"""Tile edge of the kernels: a multiple of every block (16, 32, 128) and of the swizzle's
128-row tile."""


def quantize(x, *, f: Format, axis: int, scale_mode: str, key, tile, g):
    """(codes, scales, tensor scale or None) of :func:`jaxmx.quantize` by the kernels (checked
    arguments; ``g``: NVFP4's checked ``global_scale``, None to compute it)."""
    if g is None:
        g = rule_of(f).tensor_scale(x)
    outer, size = math.prod(x.shape[:axis]), x.shape[axis]
    inner = math.prod(x.shape[axis + 1 :])
    if tile is not None:  # [outer, R, C] slabs, one scale per tile
        block, view = tile, x.reshape(-1, *x.shape[-2:])
    elif inner == 1:  # blocks along the minor axis: one [outer, size] slab, blocks along rows
        block, view = (1, f.block), x.reshape(1, outer, size)
    else:  # [size, inner] slabs, blocks along their columns
        block, view = (f.block, 1), x.reshape(outer, size, inner)
    n, a, b = view.shape
    rows, cols = ceil_div(a, block[0]), ceil_div(b, block[1])  # scales per slab
    padded = (n, rows * block[0], cols * block[1])
    if key is None:
        noise = None
    elif tile is None:  # the XLA quantizer's draws, [outer, n_blocks, block, inner]
        shape = (outer, ceil_div(size, f.block), f.block, inner)
        noise = uniform_noise(key, shape, tied_to=x).reshape(padded)
    else:  # drawn for tiles(x), [outer, n_tiles, rows * cols, 1]
        draws = uniform_noise(key, (n, rows * cols, math.prod(tile), 1), tied_to=x)
        noise = untile(draws, padded, tile)

    def run(v, draws):
        draws = None if draws is None else pad_to_tiles(draws)
        return quantize_2d(pad_to_tiles(v), f, scale_mode, block, draws, g)

    data, scale = jax.vmap(run)(view, noise)
    data, scale = data[:, : padded[1], : padded[2]], scale[:, :rows, :cols]
    return _as_codes(data, f), wire.from_bytes(scale, f.scale_dtype), g


def rowwise_colwise(x, *, f: Format, scale_mode: str, copy_keys, swizzled: bool):
    """:func:`jaxmx.quantize_rowwise_colwise` by the fused kernel: (row, col_t) and, with
    ``swizzled``, both swizzled scales. ``copy_keys``: the two copies' keys, or Nones."""
    m, k = x.shape
    nb_k, nb_m = ceil_div(k, f.block), ceil_div(m, f.block)
    g = rule_of(f).tensor_scale(x)
    row_key, col_key = copy_keys
    noise = (None, None)
    if row_key is not None:
        row = uniform_noise(row_key, (m, nb_k, f.block, 1), tied_to=x).reshape(m, nb_k * f.block)
        col = uniform_noise(col_key, (1, nb_m, f.block, k), tied_to=x).reshape(nb_m * f.block, k)
        noise = (pad_to_tiles(row), pad_to_tiles(col))
    out = quantize_rowwise_colwise_2d(
        pad_to_tiles(x), f, scale_mode, noise, swizzled, g, shape=(m, k)
    )
    row_codes, col_codes = (_as_codes(c, f) for c in out[0:3:2])
    row_scale, col_scale = (wire.from_bytes(s, f.scale_dtype) for s in out[1:4:2])
    row = MXArray(row_codes[:m, : nb_k * f.block], row_scale[:m, :nb_k], f.name, 1, (m, k), None, g)
    col_t = MXArray(
        col_codes[:k, : nb_m * f.block], col_scale[:k, :nb_m], f.name, 1, (k, m), None, g
    )
    return (row, col_t, *out[4:])


def quantize_2d(x, f: Format, scale_mode: str, block, noise=None, g=None):
    """One copy of a 2-D ``x`` [A, B] (float32, bfloat16 or float16), one scale per ``block``
    ``(r, c)`` of it: ``(1, f.block)`` along the rows, ``(f.block, 1)`` along the columns, or
    a 2-D tile whose sides divide :data:`TILE`; codes in place.

    ``noise``: stochastic-rounding draws in ``x``'s layout (padded like it), or None. ``g``:
    NVFP4's tensor scale. Returns (codes [A, B] (bytes for fp8, see :func:`_as_codes`), scales
    [A/r, B/c]: E8M0 or E4M3 bytes as uint8, block FP8's float32); ``x``'s dimensions must be
    multiples of :data:`TILE`.
    """
    a, b = x.shape
    r, c = block
    spec = pl.BlockSpec((TILE, TILE), lambda i, j: (i, j))
    inputs = _varying_alike([x] + ([] if noise is None else [noise]) + _scalar_input(g))
    in_specs = [spec] * (1 + (noise is not None)) + _scalar_spec(g)
    out = functools.partial(_out_struct, like=inputs[0])

    def kernel(*refs):
        ins, (data_ref, scale_ref) = refs[:-2], refs[-2:]
        n = ins[1][...] if noise is not None else None
        tile_g = ins[-1][...] if g is not None else None
        data_ref[...], scale_ref[...] = _quantize_tile(ins[0][...], f, scale_mode, block, n, tile_g)

    return pl.pallas_call(
        kernel,
        grid=(a // TILE, b // TILE),
        in_specs=in_specs,
        out_specs=[spec, pl.BlockSpec((TILE // r, TILE // c), lambda i, j: (i, j))],
        out_shape=[out((a, b), _code_dtype(f)), out((a // r, b // c), _scale_dtype(f))],
        interpret=True,
    )(*inputs)


def quantize_rowwise_colwise_2d(
    x,
    f: Format,
    scale_mode: str,
    noise=(None, None),
    swizzle=False,
    g=None,
    *,
    shape=None,
):
    """Both copies of a 2-D ``x`` [M, K] (float32, bfloat16 or float16; dimensions multiples of
    :data:`TILE`) from one read of each tile.

    Returns ``(row_codes [M, K], row_scales [M, K/b], col_codes [K, M], col_scales [K, M/b])``
    (``b``: the block; scales as :func:`quantize_2d` gives them) plus, with ``swizzle``, the
    two scale matrices in the cuBLAS layout (flat, as :func:`jaxmx.swizzle_scales` gives them
    for ``shape`` = the unpadded ``(M, K)``, default ``x``'s: its padding bytes zero). ``noise``:
    the rowwise and columnwise copies' stochastic-rounding draws in ``x``'s layout, or Nones.
    ``g``: NVFP4's tensor scale.
    """
    m, k = x.shape
    per_tile = TILE // f.block  # scale columns per tile
    chunk = TILE * per_tile  # swizzled bytes per tile: 128 rows x per_tile blocks
    tile = pl.BlockSpec((TILE, TILE), lambda i, j: (i, j))
    tile_t = pl.BlockSpec((TILE, TILE), lambda i, j: (j, i))
    out_specs = [
        tile,
        pl.BlockSpec((TILE, per_tile), lambda i, j: (i, j)),
        tile_t,
        pl.BlockSpec((TILE, per_tile), lambda i, j: (j, i)),
    ]
    noises = [n for n in noise if n is not None]
    x, *rest = _varying_alike([x, *noises, *_scalar_input(g)])
    out = functools.partial(_out_struct, like=x)
    out_shape = [
        out((m, k), _code_dtype(f)),
        out((m, k // f.block), _scale_dtype(f)),
        out((k, m), _code_dtype(f)),
        out((k, m // f.block), _scale_dtype(f)),
    ]
    true_m, true_k = (m, k) if shape is None else shape
    if swizzle:  # tile (i, j) owns chunk j of row group i (row copy), chunk i of group j (col)
        out_specs += [
            pl.BlockSpec((1, chunk), lambda i, j: (i, j)),
            pl.BlockSpec((1, chunk), lambda i, j: (j, i)),
        ]
        out_shape += [
            out((m // TILE, k // TILE * chunk), jnp.uint8),
            out((k // TILE, m // TILE * chunk), jnp.uint8),
        ]
    n_in = 1 + len(rest)

    def kernel(*refs):
        v = refs[0][...]
        ins = iter(r[...] for r in refs[1:n_in])
        row_draws = next(ins) if noise[0] is not None else None
        col_draws = next(ins) if noise[1] is not None else None
        tile_g = next(ins) if g is not None else None
        outs = refs[n_in:]
        row_codes, row_scale = _quantize_tile(v, f, scale_mode, (1, f.block), row_draws, tile_g)
        col_codes, col_scale = _quantize_tile(v, f, scale_mode, (f.block, 1), col_draws, tile_g)
        outs[0][...] = row_codes
        outs[1][...] = row_scale
        outs[2][...] = col_codes.T
        outs[3][...] = col_scale.T
        if swizzle:
            i, j = pl.program_id(0), pl.program_id(1)
            row_scale = _beyond_zeroed(row_scale, (i, j), (true_m, ceil_div(true_k, f.block)))
            col_scale = _beyond_zeroed(col_scale.T, (j, i), (true_k, ceil_div(true_m, f.block)))
            outs[4][...] = _swizzle_tile(row_scale)
            outs[5][...] = _swizzle_tile(col_scale)

    results = list(
        pl.pallas_call(
            kernel,
            grid=(m // TILE, k // TILE),
            in_specs=[tile] * (n_in - (g is not None)) + _scalar_spec(g),
            out_specs=out_specs,
            out_shape=out_shape,
            interpret=True,
        )(x, *rest)
    )
    if swizzle:  # whole 128x4 tiles only: the kernel's 128-element padding may hold more
        results[4] = _swizzled_tiles(results[4], true_k, f.block)
        results[5] = _swizzled_tiles(results[5], true_m, f.block)
    return tuple(results)


def pad_to_tiles(x: jax.Array) -> jax.Array:
    """``x`` [A, B] zero-padded to multiples of :data:`TILE` in both dimensions."""
    pads = [(0, -n % TILE) for n in x.shape]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


# --- the tile -------------------------------------------------------------------------------


def _quantize_tile(v, f: Format, scale_mode: str, block, noise, g):
    """(codes [T, T], scales [T/r, T/c] (see :func:`quantize_2d`)) of a tile, one scale per
    ``block`` ``(r, c)``; ``noise``: draws shaped like the tile, or None; ``g``: NVFP4's tensor
    scale as a [1, 1] array."""
    xb = _as_blocks(bits.upcast_exact(v), block)
    draws = None if noise is None else _as_blocks(noise, block)
    g = None if g is None else g.reshape(())
    with in_one_step():  # Triton lowers no optimization_barrier
        scale, values, _ = rule_of(f).scaled(xb, f, scale_mode, draws, g)
    # rounded in float arithmetic first: the integer encode's `round` has no Triton lowering
    on_grid = to_grid(values, f)
    codes = codec_of(f).kernel_codes(on_grid, f)
    (t0, t1), (r, c) = v.shape, block
    return _from_blocks(codes, v.shape, block), scale.reshape(t0 // r, t1 // c)


def _as_blocks(e, block):
    """A [T, T] tile as the per-block quantizers take it (``[outer, n_blocks, block, inner]``):
    [T, T/c, c, 1] for blocks ``(1, c)`` along the rows, [1, T/r, r, T] for ``(r, 1)`` along the
    columns, :func:`~jaxmx._src.core.blocks.tiles`' [1, n_tiles, r * c, 1] for 2-D tiles."""
    (t0, t1), (r, c) = e.shape, block
    if r == 1:
        return e.reshape(t0, t1 // c, c, 1)
    if c == 1:
        return e.reshape(1, t0 // r, r, t1)
    return tiles(e, block)


def _from_blocks(e, shape, block):
    """The inverse of :func:`_as_blocks` for a tile of ``shape``."""
    return e.reshape(shape) if 1 in block else untile(e, shape, block)


def _scalar_input(g) -> list:
    """NVFP4's tensor scale as a kernel input ([1, 1]), or no input."""
    return [] if g is None else [g.reshape(1, 1)]


def _scalar_spec(g) -> list:
    """The block spec of :func:`_scalar_input` (every tile reads the one element)."""
    return [] if g is None else [pl.BlockSpec((1, 1), lambda i, j: (0, 0))]


def _varying_alike(arrays: list) -> list:
    """``arrays`` each marked as varying over every ``shard_map`` axis any of them varies over
    (a kernel's inputs must agree; outside ``shard_map`` nothing changes)."""
    return [vary_like(a, *arrays) for a in arrays]


def _out_struct(shape, dtype, like):
    """A kernel output varying over the same ``shard_map`` axes as ``like``."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def _code_dtype(f: Format):
    return codec_of(f).kernel_dtype(f)


def _scale_dtype(f: Format):
    """The kernels' scale output: bytes for E8M0 and E4M3 scales, block FP8's float32."""
    return f.scale_dtype if f.scale_dtype == jnp.float32 else jnp.uint8


def _as_codes(data: jax.Array, f: Format) -> jax.Array:
    """The kernels' element output as ``f``'s dtype (fp8 codes come out as bytes)."""
    return codec_of(f).from_kernel(data, f)


def _beyond_zeroed(scale, tile_index, limits):
    """The [128, n] scales of tile ``tile_index`` (of a [R, C] scale matrix tiled in [128, n]
    tiles) with those at row ``>= limits[0]`` or column ``>= limits[1]`` zero: the padding
    that :func:`jaxmx.swizzle_scales` writes (NVFP4 scales of zero blocks are not zero)."""
    rows = tile_index[0] * scale.shape[0] + lax.broadcasted_iota(jnp.int32, scale.shape, 0)
    cols = tile_index[1] * scale.shape[1] + lax.broadcasted_iota(jnp.int32, scale.shape, 1)
    return jnp.where((rows < limits[0]) & (cols < limits[1]), scale, jnp.zeros_like(scale))


def _swizzle_tile(scale):
    """[128, 4 j] scale bytes -> [1, 512 j] in cuBLAS order (c0, r % 32, r // 32, c % 4)."""
    rows, cols = scale.shape
    groups = cols // COL_TILE
    s = scale.reshape(ROW_TILE // 32, 32, groups, COL_TILE)  # (r1, r2, c0, c1)
    s = lax.transpose(s, (2, 1, 0, 3))  # (c0, r2, r1, c1)
    return s.reshape(1, rows * cols)


def _swizzled_tiles(buf, size: int, block: int):
    """The kernel's [row groups, chunks] swizzled bytes -> flat, cut to the 128x4 tiles of
    ``ceil(size / block)`` scale columns (the column tiles that :func:`jaxmx.swizzle_scales`
    writes)."""
    col_tiles = ceil_div(size, block * COL_TILE)
    tiled = buf.reshape(buf.shape[0], -1, ROW_TILE * COL_TILE)
    return tiled[:, :col_tiles].reshape(-1)
