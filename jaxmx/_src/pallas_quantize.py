"""The MX quantizers as Pallas kernels: one read of the input per tile, both copies from it.

``quantize(..., impl="pallas")`` and ``quantize_rowwise_colwise(..., impl="pallas")`` run these
kernels; they give the same bytes as the XLA quantizers (``impl="xla"``): the per-tile
arithmetic is the XLA quantizer's own (:func:`jaxmx._src.quantize.scaled_blocks` and
:func:`~jaxmx._src.quantize.encode`), applied to a VMEM/SRAM tile instead of the whole array.

The fused kernel reads a 128 x 128 tile of ``x`` [M, K] once and writes the rowwise copy's codes
and scales, the columnwise copy's codes and scales physically transposed ([K, M]), and, on
request, both scale matrices in the cuBLAS 128x4 swizzled layout (each tile owns one contiguous
512-byte chunk of each). Stochastic rounding reads the uniform draws that the XLA quantizer
draws from the same key (so that the bytes agree), one more input per copy.

Lowered for a CUDA GPU the kernels are compiled (Pallas' Triton lowering); on the CPU they run
in Pallas interpret mode (slow: for tests). Inputs are zero-padded to whole tiles (padding never
changes a scale) and the outputs sliced back.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> x = jnp.linspace(-3.0, 3.0, 64 * 96).reshape(64, 96)
    >>> row, col_t = jaxmx.quantize_rowwise_colwise(x, impl="pallas")   # interpreted on a CPU
    >>> ref_row, ref_col_t = jaxmx.quantize_rowwise_colwise(x, impl="xla")
    >>> bool((row.data == ref_row.data).all() and (col_t.scale == ref_col_t.scale).all())
    True
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxmx._src import bits
from jaxmx._src.formats import Format
from jaxmx._src.mxarray import MXArray
from jaxmx._src.quantize import encode, scaled_blocks, uniform_noise
from jaxmx._src.swizzle import COL_TILE, ROW_TILE
from jaxmx._src.vma import vary_like

TILE = 128
"""Tile edge of the kernels: a multiple of the block (32) and of the swizzle's 128-row tile."""

_TRITON = pl_triton.CompilerParams(num_warps=4)
"""GPU kernels go through Pallas' Triton lowering (the default, Mosaic GPU, lacks reductions
over an axis of a tile)."""


def quantize(x, f: Format, axis: int, scale_mode: str, key, interpret: bool):
    """(codes, E8M0 scales) of :func:`jaxmx.quantize` by the kernels (checked arguments)."""
    outer, size = math.prod(x.shape[:axis]), x.shape[axis]
    inner = math.prod(x.shape[axis + 1 :])
    n_blocks = -(-size // f.block)
    padded = n_blocks * f.block
    draws = uniform_noise(key, (outer, n_blocks, f.block, inner))
    if inner == 1:  # blocks along the minor axis: [outer, size] tiles, blocks along their rows
        noise = None if draws is None else pad_to_tiles(draws.reshape(outer, -1))
        view = pad_to_tiles(x.reshape(outer, size))
        data, byte = quantize_2d(view, f, scale_mode, 1, noise, interpret=interpret)
        data, byte = data[:outer, :padded], byte[:outer, :n_blocks]
    else:  # [size, inner] slabs, blocks along their columns, one kernel grid per slab
        slabs = jax.vmap(pad_to_tiles)(x.reshape(outer, size, inner))
        run = functools.partial(
            quantize_2d, f=f, scale_mode=scale_mode, along=0, interpret=interpret
        )
        if draws is None:
            data, byte = jax.vmap(run)(slabs)
        else:
            noise = jax.vmap(pad_to_tiles)(draws.reshape(outer, padded, inner))
            data, byte = jax.vmap(lambda v, n: run(v, noise=n))(slabs, noise)
        data, byte = data[:, :padded, :inner], byte[:, :n_blocks, :inner]
    return _as_codes(data, f), lax.bitcast_convert_type(byte, jnp.float8_e8m0fnu)


def rowwise_colwise(x, f: Format, scale_mode: str, copy_keys, swizzled, interpret):
    """:func:`jaxmx.quantize_rowwise_colwise` by the fused kernel: (row, col_t) and, with
    ``swizzled``, both swizzled scales. ``copy_keys``: the two copies' keys, or Nones."""
    m, k = x.shape
    nb_k, nb_m = -(-k // f.block), -(-m // f.block)
    row_key, col_key = copy_keys
    noise = (None, None)
    if row_key is not None:
        row = uniform_noise(row_key, (m, nb_k, f.block, 1)).reshape(m, nb_k * f.block)
        col = uniform_noise(col_key, (1, nb_m, f.block, k)).reshape(nb_m * f.block, k)
        noise = (pad_to_tiles(row), pad_to_tiles(col))
    out = quantize_rowwise_colwise_2d(
        pad_to_tiles(x), f, scale_mode, noise, swizzled, interpret=interpret
    )
    e8m0 = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.float8_e8m0fnu)
    row_codes, col_codes = (_as_codes(c, f) for c in out[0:3:2])
    row = MXArray(row_codes[:m, : nb_k * f.block], e8m0(out[1][:m, :nb_k]), f.name, 1, (m, k))
    col_t = MXArray(col_codes[:k, : nb_m * f.block], e8m0(out[3][:k, :nb_m]), f.name, 1, (k, m))
    return (row, col_t, *out[4:])


def quantize_2d(x, f: Format, scale_mode: str, along: int, noise=None, *, interpret: bool):
    """One copy of a 2-D ``x`` [A, B] (float32, bfloat16 or float16), blocks along axis
    ``along`` (0 or 1), codes in place.

    ``noise``: stochastic-rounding draws in ``x``'s layout (padded like it), or None. Returns
    (codes [A, B] (bytes for fp8, see :func:`_as_codes`), E8M0 bytes as uint8: [A, B/32] or
    [A/32, B]); ``x``'s dimensions must be multiples of :data:`TILE`.
    """
    a, b = x.shape
    scale_block = (TILE, TILE // f.block) if along == 1 else (TILE // f.block, TILE)
    scale_shape = (a, b // f.block) if along == 1 else (a // f.block, b)
    spec = pl.BlockSpec((TILE, TILE), lambda i, j: (i, j))
    inputs = _varying_alike([x] if noise is None else [x, noise])
    out = functools.partial(_out_struct, like=inputs[0])

    def kernel(*refs):
        x_ref, noise_ref = refs[0], (refs[1] if noise is not None else None)
        data_ref, scale_ref = refs[-2:]
        n = None if noise_ref is None else noise_ref[...]
        codes, byte = _quantize_tile(x_ref[...], f, scale_mode, along, n)
        data_ref[...] = codes
        scale_ref[...] = byte

    return pl.pallas_call(
        kernel,
        grid=(a // TILE, b // TILE),
        in_specs=[spec] * len(inputs),
        out_specs=[spec, pl.BlockSpec(scale_block, lambda i, j: (i, j))],
        out_shape=[
            out((a, b), _code_dtype(f)),
            out(scale_shape, jnp.uint8),
        ],
        interpret=interpret,
        compiler_params=_TRITON,
    )(*inputs)


def quantize_rowwise_colwise_2d(
    x, f: Format, scale_mode: str, noise=(None, None), swizzle=False, *, interpret: bool
):
    """Both copies of a 2-D ``x`` [M, K] (float32, bfloat16 or float16; dimensions multiples of
    :data:`TILE`) from one read of each tile.

    Returns ``(row_codes [M, K], row_bytes [M, K/32], col_codes [K, M], col_bytes [K, M/32])``
    plus, with ``swizzle``, the two byte matrices in the cuBLAS layout (flat, as
    :func:`jaxmx.swizzle_scales` gives them). ``noise``: the rowwise and columnwise copies'
    stochastic-rounding draws in ``x``'s layout, or Nones.
    """
    m, k = x.shape
    per_tile = TILE // f.block  # scale columns per tile
    chunk = TILE * per_tile  # swizzled bytes per tile: 128 rows x 4 blocks = 512
    tile = pl.BlockSpec((TILE, TILE), lambda i, j: (i, j))
    tile_t = pl.BlockSpec((TILE, TILE), lambda i, j: (j, i))
    out_specs = [
        tile,
        pl.BlockSpec((TILE, per_tile), lambda i, j: (i, j)),
        tile_t,
        pl.BlockSpec((TILE, per_tile), lambda i, j: (j, i)),
    ]
    x, *noises = _varying_alike([x, *(n for n in noise if n is not None)])
    out = functools.partial(_out_struct, like=x)
    out_shape = [
        out((m, k), _code_dtype(f)),
        out((m, k // f.block), jnp.uint8),
        out((k, m), _code_dtype(f)),
        out((k, m // f.block), jnp.uint8),
    ]
    if swizzle:  # tile (i, j) owns chunk j of row group i (row copy), chunk i of group j (col)
        out_specs += [
            pl.BlockSpec((1, chunk), lambda i, j: (i, j)),
            pl.BlockSpec((1, chunk), lambda i, j: (j, i)),
        ]
        out_shape += [
            out((m // TILE, k // TILE * chunk), jnp.uint8),
            out((k // TILE, m // TILE * chunk), jnp.uint8),
        ]
    n_in = 1 + len(noises)

    def kernel(*refs):
        v = refs[0][...]
        draws = iter(r[...] for r in refs[1:n_in])
        row_draws = next(draws) if noise[0] is not None else None
        col_draws = next(draws) if noise[1] is not None else None
        outs = refs[n_in:]
        row_codes, row_byte = _quantize_tile(v, f, scale_mode, 1, row_draws)
        col_codes, col_byte = _quantize_tile(v, f, scale_mode, 0, col_draws)
        outs[0][...] = row_codes
        outs[1][...] = row_byte
        outs[2][...] = col_codes.T
        outs[3][...] = col_byte.T
        if swizzle:
            outs[4][...] = _swizzle_tile(row_byte)
            outs[5][...] = _swizzle_tile(col_byte.T)

    results = list(
        pl.pallas_call(
            kernel,
            grid=(m // TILE, k // TILE),
            in_specs=[tile] * n_in,
            out_specs=out_specs,
            out_shape=out_shape,
            interpret=interpret,
            compiler_params=_TRITON,
        )(x, *noises)
    )
    if swizzle:
        results[4] = results[4].reshape(-1)
        results[5] = results[5].reshape(-1)
    return tuple(results)


def pad_to_tiles(x: jax.Array) -> jax.Array:
    """``x`` [A, B] zero-padded to multiples of :data:`TILE` in both dimensions."""
    pads = [(0, -n % TILE) for n in x.shape]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


# --- the tile -------------------------------------------------------------------------------


def _quantize_tile(v, f: Format, scale_mode: str, along: int, noise):
    """(codes [T, T], E8M0 bytes as uint8 [T, T/32] or [T/32, T]) of a float32 tile."""
    v = bits.upcast_exact(v)
    t0, t1 = v.shape
    if along == 1:
        blocked = (t0, t1 // f.block, f.block, 1)
        scale_shape = (t0, t1 // f.block)
    else:
        blocked = (1, t0 // f.block, f.block, t1)
        scale_shape = (t0 // f.block, t1)
    draws = None if noise is None else noise.reshape(blocked)
    byte, values = scaled_blocks(v.reshape(blocked), f, scale_mode, draws)
    # rounded in float arithmetic first: the integer encode's `round` has no Triton lowering
    on_grid = bits.round_to_grid(values, f.mbits, f.emin)
    if f.is_fp8:  # bytes: Triton stores uint8 on every GPU, fp8 types only on some
        codes = bits.encode_fp8(on_grid, f.mbits, f.emin, on_grid=True)
    else:
        codes = encode(on_grid, f, on_grid=True)
    codes = codes.reshape(v.shape)
    return codes, byte.reshape(scale_shape).astype(jnp.uint8)


def _varying_alike(arrays: list) -> list:
    """``arrays`` each marked as varying over every ``shard_map`` axis any of them varies over
    (a kernel's inputs must agree; outside ``shard_map`` nothing changes)."""
    return [vary_like(a, *arrays) for a in arrays]


def _out_struct(shape, dtype, like):
    """A kernel output varying over the same ``shard_map`` axes as ``like``."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def _code_dtype(f: Format):
    return jnp.uint8 if f.is_fp8 else f.dtype


def _as_codes(data: jax.Array, f: Format) -> jax.Array:
    """The kernels' element output as ``f``'s dtype (fp8 codes come out as bytes)."""
    return bits.from_bytes(data, f.dtype) if f.is_fp8 else data


def _swizzle_tile(byte):
    """[128, 4 j] scale bytes -> [1, 512 j] in cuBLAS order (c0, r % 32, r // 32, c % 4)."""
    rows, cols = byte.shape
    groups = cols // COL_TILE
    s = byte.reshape(ROW_TILE // 32, 32, groups, COL_TILE)  # (r1, r2, c0, c1)
    s = lax.transpose(s, (2, 1, 0, 3))  # (c0, r2, r1, c1)
    return s.reshape(1, rows * cols)
