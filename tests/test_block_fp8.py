"""Block FP8 (1x128 blocks, 128x128 tiles, float32 scales) and 2-D MX tiles, against numpy."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference as ref

import jaxmx

BLOCK_FORMATS = ("fp8_e4m3_block", "fp8_e5m2_block")


def adversarial(shape=(300, 260), seed=0) -> np.ndarray:
    """Outlier rows and columns, all-zero and NaN/inf blocks, a tiny block; sizes not a multiple
    of 128 (padding)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[7] *= 1e4  # an outlier row
    x[:, 3] *= 3e3  # an outlier column
    x[130:140, :128] = 0.0  # zero blocks (1x128) ...
    x[256:, 128:256] = 0.0  # ... and a zero 128x128 tile (rows 256..299, padding below)
    x[200, 140], x[210, 30] = np.nan, np.inf
    x[290:300, 256:] = 1e-37  # a block below 448 * 2^-126: its fp32 scale is clamped
    x[296:300, :128] = rng.standard_normal((4, 128)) * np.float32(2.0**-135)  # subnormals
    return x


def as_uint8(a):
    return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("fmt", sorted(BLOCK_FORMATS))
@pytest.mark.parametrize("mode", ["fp32", "pow2"])
@pytest.mark.parametrize("layout", [(1, None), (0, None), (1, (128, 128)), (1, (64, 128))])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_quantize_equals_the_definition(fmt, mode, layout, dtype):
    axis, tile = layout
    x = adversarial()
    if dtype == jnp.float16:
        x = np.where(np.abs(x) > 6e4, np.sign(x) * 6e4, x)  # float16's range
        x[290:300, 256:] = 1e-4
        x[296:300, :128] = 1e-6
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # the values the quantizer sees
    q = jaxmx.quantize(jnp.asarray(x, dtype), fmt, axis=axis, scale_mode=mode, tile=tile)
    codes, scales = ref.block_fp8(x, fmt, mode, axis, tile)
    assert q.scale.dtype == jnp.float32 and q.tile == tile
    np.testing.assert_array_equal(np.asarray(q.scale), scales)
    nan = np.isnan(codes.astype(np.float32))  # any NaN code: the byte is the codec's choice
    np.testing.assert_array_equal(np.isnan(np.asarray(q.data, np.float32)), nan)
    np.testing.assert_array_equal(as_uint8(q.data)[~nan], as_uint8(codes)[~nan])


@pytest.mark.parametrize("fmt", sorted(BLOCK_FORMATS))
@pytest.mark.parametrize("tile", [None, (128, 128)])
@pytest.mark.parametrize("mode", ["fp32", "pow2"])
def test_dequantize_is_codes_times_scales(fmt, tile, mode):
    """Every value is the numpy float32 product code * scale, subnormal products included."""
    x = adversarial()
    q = jaxmx.quantize(jnp.asarray(x), fmt, tile=tile, scale_mode=mode)
    codes, scales = ref.block_fp8(x, fmt, mode, -1, tile)
    rows, cols = tile or (1, 128)
    expanded = np.repeat(np.repeat(scales, rows, -2), cols, -1)
    want = (codes.astype(np.float32) * expanded)[: x.shape[0], : x.shape[1]]
    got = np.asarray(jaxmx.dequantize(q))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.isnan(got[200, 140]) and np.isnan(got[210, 30])


@pytest.mark.parametrize("fmt", sorted(BLOCK_FORMATS))
@pytest.mark.parametrize("mode", ["fp32", "pow2"])
def test_tiny_blocks_are_not_flushed(fmt, mode):
    """Blocks whose scale (2^-127 under pow2) or values are float32 subnormals decode exactly,
    in dequantize and fake_quantize alike, and the emulated GEMM sees them."""
    x = np.float32(2.0 ** np.arange(-150, -110, dtype=np.float64)[:, None]) * np.ones(
        (1, 128), np.float32
    )
    x[:, 1] *= np.float32(1.75)
    codes, scales = ref.block_fp8(x, fmt, mode, -1, None)
    want = codes.astype(np.float32) * np.repeat(scales, 128, -1)
    assert np.any(want[:, 0] != 0) and np.any(np.abs(want[:, 0]) < 2.0**-126)
    q = jaxmx.quantize(jnp.asarray(x), fmt, scale_mode=mode)
    got = np.asarray(jaxmx.dequantize(q))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    fake = np.asarray(jaxmx.fake_quantize(jnp.asarray(x), fmt, scale_mode=mode))
    np.testing.assert_array_equal(fake.view(np.uint32), want.view(np.uint32))


def test_pow2_tiny_block_gemm_matches_numpy():
    """2^-120 (scale 2^-127) times 2^100, over K = 128: 2^-13 exactly, as the CPU handler has."""
    a = jaxmx.quantize(jnp.full((2, 128), 2.0**-120), "fp8_e4m3_block", scale_mode="pow2")
    b = jaxmx.quantize(jnp.full((3, 128), 2.0**100), "fp8_e4m3_block", scale_mode="pow2")
    assert float(jaxmx.dequantize(a)[0, 0]) == 2.0**-120
    want = np.full((2, 3), np.float32(128) * np.float32(2.0**-120) * np.float32(2.0**100))
    np.testing.assert_array_equal(np.asarray(jaxmx.matmul(a, b, out_dtype=jnp.float32)), want)


@pytest.mark.parametrize(
    "fmt, tile",
    [("fp8_e4m3_block", (128, 128)), ("mxfp8_e4m3", (32, 32)), ("fp8_e4m3_block", (64, 128))],
)
def test_a_tiled_transpose_holds_the_same_bytes(fmt, tile):
    x = jnp.asarray(adversarial())
    q = jaxmx.quantize(x, fmt, tile=tile)
    qt = jaxmx.quantize(x.T, fmt, tile=tile[::-1])
    np.testing.assert_array_equal(as_uint8(q.data).T, as_uint8(qt.data))
    np.testing.assert_array_equal(
        np.asarray(q.scale, np.float32).T, np.asarray(qt.scale, np.float32)
    )


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_mx_tiles_use_the_mx_rule_per_tile(mode):
    x = adversarial()[:96, :100]  # outlier row and column, zero blocks, 100 = 3 tiles + 4
    q = jaxmx.quantize(jnp.asarray(x), "mxfp8_e4m3", scale_mode=mode, tile=(32, 32))
    assert q.scale.shape == (3, 4) and q.scale.dtype == jnp.float8_e8m0fnu
    padded = np.pad(x, [(0, 0), (0, 28)])
    for i in range(3):
        for j in range(4):
            t = padded[32 * i : 32 * (i + 1), 32 * j : 32 * (j + 1)]
            byte = ref.scale_byte(np.max(np.abs(t)), "mxfp8_e4m3", mode)
            assert as_uint8(q.scale)[i, j] == byte
            if byte != ref.E8M0_NAN:
                grid = ref.round_to_grid(t.astype(np.float64) / 2.0 ** (byte - 127), "mxfp8_e4m3")
                codes = grid.astype(ml_dtypes.float8_e4m3fn)
                np.testing.assert_array_equal(
                    as_uint8(q.data[32 * i : 32 * (i + 1), 32 * j : 32 * (j + 1)]), as_uint8(codes)
                )


def test_bad_block_arguments():
    x = jnp.ones((4, 256))
    with pytest.raises(ValueError, match="scale_mode 'rceil' for fp8_e4m3_block"):
        jaxmx.quantize(x, "fp8_e4m3_block", scale_mode="rceil")
    with pytest.raises(ValueError, match="scale_mode 'fp32' for mxfp8_e4m3"):
        jaxmx.quantize(x, "mxfp8_e4m3", scale_mode="fp32")
    with pytest.raises(ValueError, match="with tile, axis must be the last axis"):
        jaxmx.quantize(x, "fp8_e4m3_block", axis=0, tile=(128, 128))
    with pytest.raises(ValueError, match="tile must be a pair"):
        jaxmx.quantize(x, "fp8_e4m3_block", tile=128)
    with pytest.raises(ValueError, match="rank >= 2"):
        jaxmx.quantize(jnp.ones(256), "fp8_e4m3_block", tile=(128, 128))
    q = jaxmx.quantize(x, "fp8_e4m3_block")
    with pytest.raises(TypeError, match="fp8_e4m3_block MXArray scales must be float32"):
        jaxmx.MXArray(q.data, q.scale.astype(jnp.bfloat16), q.fmt, q.axis, q.shape)
