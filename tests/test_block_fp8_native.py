"""The native block-FP8 GEMM (jaxmx.ffi.block_fp8_matmul, custom call jaxmx_block_fp8_matmul),
checked on the CPU handler.

The reference is numpy + ml_dtypes only: codes decoded by ml_dtypes, each times its block's (or
tile's) float32 scale rounded to float32 (the emulation's dequantize), then a float64 GEMM.
"""

from __future__ import annotations

import bounds
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from machines import HOPPER

import jaxmx
from jaxmx import ffi

E4, E5 = "fp8_e4m3_block", "fp8_e5m2_block"
OUT_EPS = {jnp.float32: 0.0, jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11}
TILE = (128, 128)

quantize = jax.jit(jaxmx.quantize, static_argnames=("fmt", "axis", "tile"))


def dequantized(q) -> np.ndarray:
    """float64 of float32(code * scale) over the logical [..., rows, K] of a TN operand."""
    codes = np.asarray(q.data).astype(np.float32)
    scale = np.asarray(q.scale, np.float32)
    rows, cols = q.tile or (1, 128)
    expanded = np.repeat(np.repeat(scale, rows, axis=-2), cols, axis=-1)
    values = (codes * expanded).astype(np.float64)  # float32 products, as dequantize
    return values[..., : q.shape[-2], : q.shape[-1]]


def assert_gemm_close(out, a, b, out_dtype):
    """|out - exact| within float32 accumulation over K plus the output rounding."""
    x, y = dequantized(a), dequantized(b)
    exact = np.einsum("...mk,...nk->...mn", x, y)
    abs_sum = np.einsum("...mk,...nk->...mn", abs(x), abs(y))
    k = x.shape[-1]
    tol = 2 * k * 2.0**-24 * abs_sum + OUT_EPS[out_dtype] * np.abs(exact) + 1e-30
    err = np.abs(np.asarray(out).astype(np.float64) - exact)
    assert out.shape == exact.shape
    assert np.all(err <= tol), f"worst err {err.max()} where tol {tol[err > tol].min()}"


def operand(key, rows, k, fmt, tile=None, spread=6, batch=()):
    """Quantized normal data with rows and columns spanning 2^-spread .. 2^spread."""
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, (*batch, rows, k))
    x = x * 2.0 ** jax.random.randint(k2, (*batch, rows, 1), -spread, spread + 1)
    x = x * 2.0 ** jax.random.randint(k3, (*batch, 1, k), -spread, spread + 1)
    return quantize(x, fmt, tile=tile)


@pytest.mark.parametrize("m,n,k", [(1, 16, 128), (200, 136, 384), (128, 256, 300), (37, 129, 256)])
@pytest.mark.parametrize("tiles", [(None, None), (None, TILE), (TILE, None), (TILE, TILE)])
def test_block_fp8_matmul_matches_numpy(m, n, k, tiles):
    key = jax.random.split(jax.random.key(m * n + k), 2)
    a = operand(key[0], m, k, E4, tiles[0])
    b = operand(key[1], n, k, E4, tiles[1])
    assert_gemm_close(ffi.block_fp8_matmul(a, b, jnp.float32), a, b, jnp.float32)


@pytest.mark.parametrize("fmts", [(E5, E4), (E4, E5)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_formats_and_output_types(fmts, out_dtype):
    key = jax.random.split(jax.random.key(1), 2)
    a = operand(key[0], 64, 256, fmts[0], spread=3)
    b = operand(key[1], 144, 256, fmts[1], TILE, spread=3)
    out = ffi.block_fp8_matmul(a, b, out_dtype)
    assert out.dtype == out_dtype
    assert_gemm_close(out, a, b, out_dtype)


def test_equals_the_emulation():
    key = jax.random.split(jax.random.key(2), 2)
    a = operand(key[0], 96, 512, E4)
    b = operand(key[1], 256, 512, E4, TILE)
    native = jaxmx.matmul(a, b, jnp.float32, backend="ffi")
    emulated = jaxmx.matmul(a, b, jnp.float32, backend="emulate")
    abs_sum = bounds.abs_products(dequantized(a), dequantized(b))
    bounds.assert_within(native, emulated, bounds.between(abs_sum, 512, emulated))


def test_nan_blocks_propagate():
    x = np.ones((4, 256), np.float32)
    x[1, 130] = np.nan  # row 1, K-block 1
    a, b = quantize(jnp.asarray(x), E4), quantize(jnp.ones((8, 256)), E4, tile=TILE)
    out = np.asarray(ffi.block_fp8_matmul(a, b, jnp.float32))
    assert np.isnan(out[1]).all() and not np.isnan(out[[0, 2, 3]]).any()


def test_whole_tiles_reach_cublaslt_as_tiles():
    """128x128 tile scales where the tiled operand's rows are whole tiles, else 1x128."""
    a = operand(jax.random.key(3), 64, 256, E4)

    def attributes(b):
        f = jax.jit(lambda a, b: ffi.block_fp8_matmul(a, b))
        text = f.trace(a, b).lower(lowering_platforms=("cpu",)).as_text()
        assert "jaxmx_block_fp8_matmul" in text
        return "rhs_tiled = true" in text, "lhs_tiled = true" in text

    assert attributes(operand(jax.random.key(4), 256, 256, E4, TILE)) == (True, False)
    assert attributes(operand(jax.random.key(4), 200, 256, E4, TILE)) == (False, False)
    assert attributes(operand(jax.random.key(4), 256, 256, E4)) == (False, False)


def test_batch_dims_and_vmap_agree_with_single_calls():
    key = jax.random.split(jax.random.key(5), 2)
    qa = operand(key[0], 40, 256, E4, batch=(3,))
    qb = operand(key[1], 128, 256, E4, TILE, batch=(3,))
    mm = lambda p, q: ffi.block_fp8_matmul(p, q, jnp.float32)

    def part(q, i):  # element i of the leading batch dim, as an MXArray of its own
        return jaxmx.MXArray(q.data[i], q.scale[i], q.fmt, q.axis - 1, q.shape[1:], q.tile)

    single = np.stack([mm(part(qa, i), part(qb, i)) for i in range(3)])
    tol = bounds.between(bounds.abs_products(dequantized(qa), dequantized(qb)), 256, single)
    bounds.assert_within(mm(qa, qb), single, tol, "batch dims")
    bounds.assert_within(jax.jit(jax.vmap(mm))(qa, qb), single, tol, "vmap")
    # a batched lhs against one shared tiled rhs (folded into M): the tiles stay whole
    b0 = part(qb, 0)
    want = np.stack([mm(part(qa, i), b0) for i in range(3)])
    tol = bounds.between(bounds.abs_products(dequantized(qa), dequantized(b0)), 256, want)
    bounds.assert_within(jax.vmap(mm, in_axes=(0, None))(qa, b0), want, tol, "shared rhs")


def test_sharded_rows_and_k_equal_one_device():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    key = jax.random.split(jax.random.key(6), 2)
    a = operand(key[0], 64, 1024, E4)
    b = operand(key[1], 512, 1024, E4, TILE)
    want = ffi.block_fp8_matmul(a, b, jnp.float32)

    def shard(q, spec):
        return jax.device_put(q, jax.tree.map(lambda _: NamedSharding(mesh, spec), q))

    # lhs rows over "data", rhs rows (whole 128-row tiles per device) over "model"
    got = jax.jit(lambda a, b: ffi.block_fp8_matmul(a, b, jnp.float32))(
        shard(a, P("data", None)), shard(b, P("model", None))
    )
    tol = bounds.between(bounds.abs_products(dequantized(a), dequantized(b)), 1024, want)
    bounds.assert_within(got, want, tol, "rows sharded")
    # K over "model": float32 partial sums, one psum
    got = jax.jit(lambda a, b: ffi.block_fp8_matmul(a, b, jnp.float32))(
        shard(a, P(None, "model")), shard(jaxmx.MXArray(*_untiled_leaves(b)), P(None, "model"))
    )
    bounds.assert_within(got, want, tol, "K sharded")


def _untiled_leaves(q):
    """``q`` (tiled) as 1-D blocks: data, per-row scales, format, axis, shape."""
    scale = jnp.repeat(q.scale, 128, axis=-2)[: q.shape[-2]]
    return q.data[: q.shape[-2]], scale, q.fmt, q.axis, q.shape


def test_python_side_errors():
    a = operand(jax.random.key(7), 8, 256, E4)
    with pytest.raises(NotImplementedError, match="a is mxfp8_e4m3, which this native GEMM"):
        ffi.block_fp8_matmul(jaxmx.quantize(jnp.ones((8, 256))), a)
    e5 = operand(jax.random.key(7), 8, 256, E5)
    with pytest.raises(NotImplementedError, match="fp8_e5m2_block x fp8_e5m2_block"):
        ffi.block_fp8_matmul(e5, e5)
    with pytest.raises(ValueError, match=r"b has \(64, 128\) tiles"):
        ffi.block_fp8_matmul(a, quantize(jnp.ones((8, 256)), E4, tile=(64, 128)))
    with pytest.raises(ValueError, match="TN form"):
        ffi.block_fp8_matmul(a, quantize(jnp.ones((256, 8)), E4, axis=0))
    with pytest.raises(ValueError, match="contracting sizes differ"):
        ffi.block_fp8_matmul(a, operand(jax.random.key(7), 8, 384, E4))


@pytest.mark.cublaslt  # auto picks the CUDA handler for whole tiles
def test_auto_emulates_tiles_the_native_gemm_does_not_take(machine):
    machine(HOPPER)
    a = operand(jax.random.key(8), 8, 256, E4)

    def lowered(b):
        f = jax.jit(lambda a, b: jaxmx.matmul(a, b))
        return f.trace(a, b).lower(lowering_platforms=("cuda",)).as_text()

    assert "jaxmx_block_fp8_matmul" in lowered(quantize(jnp.ones((8, 256)), E4, tile=TILE))
    assert "jaxmx_block_fp8_matmul" not in lowered(quantize(jnp.ones((8, 256)), E4, tile=(64, 128)))


def raw_call(out_shape, lhs, rhs, lhs_scale, rhs_scale, lhs_tiled=False, rhs_tiled=False):
    ffi.register_targets()
    out, _ = jax.ffi.ffi_call(
        ffi.BLOCK_FP8_TARGET,
        (jax.ShapeDtypeStruct(out_shape, jnp.float32), jax.ShapeDtypeStruct((0,), jnp.uint8)),
    )(lhs, rhs, lhs_scale, rhs_scale, lhs_tiled=lhs_tiled, rhs_tiled=rhs_tiled)
    return np.asarray(out)


def test_cpp_reads_the_documented_scale_layouts():
    """1x128: [K/128, rows], rows contiguous; 128x128: [ceil(rows/128), roundup(K/128, 4)]."""
    rng = np.random.default_rng(0)
    m, n, k = 8, 130, 256
    lhs = rng.integers(-8, 8, (m, k)).astype(ml_dtypes.float8_e4m3fn)
    rhs = rng.integers(-8, 8, (n, k)).astype(ml_dtypes.float8_e4m3fn)
    sa = (2.0 ** rng.integers(-4, 4, (k // 128, m))).astype(np.float32)  # [K/128, M]
    sb = np.zeros((2, 4), np.float32)  # [ceil(130/128), roundup(2, 4)]
    sb[:, :2] = 2.0 ** rng.integers(-4, 4, (2, 2))
    out = raw_call((m, n), lhs, rhs, sa, sb, rhs_tiled=True)
    x = lhs.astype(np.float64) * np.repeat(sa.T, 128, axis=1)
    y = rhs.astype(np.float64) * np.repeat(np.repeat(sb[:, :2], 128, axis=0)[:n], 128, axis=1)
    np.testing.assert_array_equal(out, x @ y.T)  # small integers times powers of two: exact


def test_cpp_side_errors():
    e4 = jnp.zeros((4, 256), jnp.float8_e4m3fn)
    vec = jnp.zeros((2, 4), jnp.float32)  # [K/128, rows]
    tiles = jnp.zeros((1, 4), jnp.float32)  # [ceil(rows/128), roundup(K/128, 4)]
    assert raw_call((4, 4), e4, e4, vec, tiles, rhs_tiled=True).shape == (4, 4)
    cases = [
        ((e4[:, :192], e4[:, :192], vec, vec), {}, "K must be a multiple of 128"),
        ((e4, e4, vec.T, vec), {}, r"lhs scales of a \[4, 256\] operand must have shape"),
        ((e4, e4, vec, vec), {"rhs_tiled": True}, r"\[..., 1, 4\] \(128x128 tiles"),
        ((e4, e4, vec, vec.astype(jnp.bfloat16)), {}, "rhs scales must be float32"),
        ((e4, e4, tiles, tiles), {"lhs_tiled": True, "rhs_tiled": True}, "cannot both"),
        ((e4.astype(jnp.float8_e5m2), e4.astype(jnp.float8_e5m2), vec, vec), {}, "e5m2 x"),
    ]
    for args, attrs, msg in cases:
        with pytest.raises(Exception, match=f"jaxmx_block_fp8_matmul: .*{msg}"):
            raw_call((4, 4), *args, **attrs)


@pytest.mark.cublaslt
def test_the_cuda_lowering_pads_1x128_rows_to_16_and_lays_out_the_scales():
    a = operand(jax.random.key(9), 6, 256, E4)  # 1x128: rows padded to 16, scales [2, 16]
    b = operand(jax.random.key(10), 256, 256, E4, TILE)  # whole tiles: scales [2, 4]
    f = jax.jit(lambda a, b: ffi.block_fp8_matmul(a, b, jnp.float32))
    text = f.trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
    call = [line for line in text.splitlines() if "jaxmx_block_fp8_matmul" in line]
    assert call, text
    assert "tensor<16x256xf8E4M3FN>, tensor<256x256xf8E4M3FN>" in call[0]
    assert "tensor<2x16xf32>, tensor<2x4xf32>" in call[0]
    assert "tensor<16x256xf32>" in call[0]  # sliced back to [6, 256] after the call
    assert f(a, b).shape == (6, 256)
