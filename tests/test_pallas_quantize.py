"""The Pallas quantizers (interpreted on the CPU) give the XLA quantizers' bytes.

``impl="xla"`` is checked against the independent references in tests/test_quantize.py,
tests/test_block_fp8.py and tests/test_nvfp4.py; here ``impl="pallas"`` must equal it byte for
byte: codes, scales (and NVFP4's tensor scale) of one copy along each axis, of 2-D tiles and of
both copies, compact and swizzled, on those tests' adversarial corpora, for every format and
scale mode, with round-to-nearest and stochastic rounding. Sizes are small: interpret mode is
slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference as ref
from test_block_fp8 import adversarial as block_adversarial
from test_nvfp4 import adversarial as nvfp4_adversarial
from test_quantize import CORPUS, FORMATS, MODES

import jaxmx
from jaxmx._src.gemm import native
from jaxmx._src.quantize import quantize as quantize_module

ALL = [(f, m) for f in FORMATS for m in MODES]
BLOCK_FP8 = [(f, m) for f in ("fp8_e4m3_block", "fp8_e5m2_block") for m in ("fp32", "pow2")]


def _same_bytes(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(la, lb, strict=True):
        assert u.dtype == v.dtype and u.shape == v.shape
        u, v = np.asarray(u).reshape(-1), np.asarray(v).reshape(-1)  # 1-D: NVFP4's scalar g
        np.testing.assert_array_equal(u.view(np.uint8), v.view(np.uint8))


def _both(fn, *args, **kw):
    """``fn(*args, impl="pallas", **kw)`` after checking that it has ``impl="xla"``'s bytes."""
    got = fn(*args, impl="pallas", **kw)
    _same_bytes(got, fn(*args, impl="xla", **kw))
    return got


def _corpus_matrix() -> np.ndarray:
    """The corpus as [rows, 160]: tiles with NaN/Inf blocks, every scale edge, and a K that is
    not a multiple of the 128-element tile (nor an M, along the columns)."""
    flat = CORPUS.reshape(-1)
    rows = flat.size // 160
    return flat[: rows * 160].reshape(rows, 160)[:300]


@pytest.mark.parametrize(("fmt", "mode"), ALL)
def test_rowwise_colwise_corpus(fmt, mode):
    x = jnp.asarray(_corpus_matrix())
    got = jaxmx.quantize_rowwise_colwise(x, fmt, mode, impl="pallas", swizzled_scales=True)
    want = jaxmx.quantize_rowwise_colwise(x, fmt, mode, impl="xla", swizzled_scales=True)
    _same_bytes(got, want)
    row, col_t = got[:2]
    assert (row.shape, col_t.shape) == (x.shape, x.shape[::-1])
    # the swizzled buffers are the compact scales in the cuBLAS layout
    np.testing.assert_array_equal(
        np.asarray(got[2]), ref.swizzle(np.asarray(row.scale).view(np.uint8))
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_rowwise_colwise_stochastic_rounding(fmt):
    x = jnp.asarray(_corpus_matrix()[:140], jnp.bfloat16)
    key = jax.random.key(1)
    got = jaxmx.quantize_rowwise_colwise(x, fmt, key=key, impl="pallas")
    _same_bytes(got, jaxmx.quantize_rowwise_colwise(x, fmt, key=key, impl="xla"))
    nearest = jaxmx.quantize_rowwise_colwise(x, fmt, impl="pallas")
    assert (np.asarray(nearest[0].data) != np.asarray(got[0].data)).any()


@pytest.mark.parametrize(
    ("shape", "axis", "dtype"),
    [
        ((200, 160), 1, np.float32),
        ((200, 160), 0, np.float32),
        ((33, 70), 1, ml_dtypes.bfloat16),
        ((33, 70), 0, np.float16),
        ((3, 40, 5), 1, ml_dtypes.bfloat16),
        ((2, 3, 64), -1, np.float32),
    ],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_one_copy(shape, axis, dtype, fmt):
    size = int(np.prod(shape))
    x = jnp.asarray(np.resize(CORPUS.reshape(-1), size).reshape(shape).astype(dtype))
    got = jaxmx.quantize(x, fmt, axis, "floor", impl="pallas")
    _same_bytes(got, jaxmx.quantize(x, fmt, axis, "floor", impl="xla"))
    key = jax.random.key(4)
    got = jaxmx.quantize(x, fmt, axis, key=key, impl="pallas")
    _same_bytes(got, jaxmx.quantize(x, fmt, axis, key=key, impl="xla"))


def _nvfp4_matrix(shape=(150, 160), scale_exponent=0, dtype=np.float32) -> np.ndarray:
    """NVFP4's adversarial values (zeros, subnormals, 3e38 outliers, E2M1 ties) times
    ``2^scale_exponent``: tiny tensors take the subnormal paths of the scale arithmetic."""
    x = nvfp4_adversarial(np.random.default_rng(scale_exponent + 300), shape)
    return (x.astype(np.float64) * 2.0**scale_exponent).astype(np.float32).astype(dtype)


@pytest.mark.parametrize(("fmt", "mode"), BLOCK_FP8)
def test_block_fp8_one_copy_and_tiles(fmt, mode):
    x = jnp.asarray(block_adversarial())  # NaN/inf, zero and tiny blocks; 300 x 260
    for axis, tile in [(1, None), (0, None), (1, (128, 128)), (1, (64, 128))]:
        q = _both(jaxmx.quantize, x, fmt, axis, mode, tile=tile)
        assert q.scale.dtype == jnp.float32 and q.tile == tile


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_block_fp8_half_precision_and_stochastic_rounding(dtype):
    x = jnp.asarray(np.clip(block_adversarial()[:140, :200], -6e4, 6e4).astype(dtype))
    key = jax.random.key(2)
    got = _both(jaxmx.quantize, x, "fp8_e4m3_block", 0, "pow2", key=key)
    nearest = jaxmx.quantize(x, "fp8_e4m3_block", 0, "pow2", impl="pallas")
    assert (np.asarray(nearest.data) != np.asarray(got.data)).any()
    _both(jaxmx.quantize, x, "fp8_e5m2_block", key=key, tile=(128, 128))


@pytest.mark.parametrize(("fmt", "mode"), BLOCK_FP8)
def test_block_fp8_rowwise_colwise(fmt, mode):
    x = jnp.asarray(block_adversarial()[:200, :260])
    row, col_t = _both(jaxmx.quantize_rowwise_colwise, x, fmt, mode)
    assert (row.shape, col_t.shape) == (x.shape, x.shape[::-1])
    _both(jaxmx.quantize_rowwise_colwise, x[:140], fmt, mode, key=jax.random.key(3))
    for impl in ("xla", "pallas"):  # float32 scales have no cuBLAS swizzled layout
        with pytest.raises(ValueError, match=f"not the float32 scales of {fmt}"):
            jaxmx.quantize_rowwise_colwise(x, fmt, mode, impl=impl, swizzled_scales=True)


@pytest.mark.parametrize("scale_exponent", [0, -128, -140])
def test_nvfp4_one_copy_and_tiles(scale_exponent):
    """Huge outliers (g ~ 1e35, most block scales clamped), and tiny tensors: subnormal block
    maxima, ratios and elements."""
    x = jnp.asarray(_nvfp4_matrix(scale_exponent=scale_exponent))
    for axis, tile in [(1, None), (0, None), (1, (16, 16)), (1, (32, 16))]:
        q = _both(jaxmx.quantize, x, "nvfp4", axis, tile=tile)
        assert q.global_scale.dtype == jnp.float32 and q.tile == tile


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_nvfp4_half_precision_given_scale_and_stochastic_rounding(dtype):
    x = jnp.asarray(np.clip(_nvfp4_matrix((40, 70)), -100, 100).astype(dtype))  # no outlier
    key = jax.random.key(5)
    got = _both(jaxmx.quantize, x, "nvfp4", 0, key=key)
    nearest = jaxmx.quantize(x, "nvfp4", 0, impl="pallas")
    assert (np.asarray(nearest.data).view(np.uint8) != np.asarray(got.data).view(np.uint8)).any()
    _both(jaxmx.quantize, x, "nvfp4", key=key, tile=(16, 16))
    _both(jaxmx.quantize, x, "nvfp4", global_scale=jnp.float32(0.01))  # blocks saturate
    x = x.at[3, 5].set(jnp.inf)  # g is NaN: every scale NaN, every code zero
    _both(jaxmx.quantize, x, "nvfp4")
    _both(jaxmx.quantize, x, "nvfp4", global_scale=1.0 / 2688)  # only the inf's block is NaN


@pytest.mark.parametrize("scale_exponent", [0, -135])
def test_nvfp4_rowwise_colwise_swizzled(scale_exponent):
    """150 x 160: the kernel pads both to 256, more than the swizzled layout's 128x4 tiles of
    10 scale columns (12): the extra tiles are cut and the padding bytes are zero."""
    x = jnp.asarray(_nvfp4_matrix(scale_exponent=scale_exponent))
    row, col_t, row_sw, col_sw = _both(
        jaxmx.quantize_rowwise_colwise, x, "nvfp4", swizzled_scales=True
    )
    assert row.global_scale is not None and bool(row.global_scale == col_t.global_scale)
    for q, buf in ((row, row_sw), (col_t, col_sw)):
        want = ref.swizzle(np.asarray(q.scale).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(buf), want)
        assert want.shape == (256 * 12,)
        # the layout the native FP4 GEMM hands cuBLASLt (its scales, K padded to 32, swizzled)
        fed = jaxmx.swizzle_scales(native.fp4_scales(q))
        np.testing.assert_array_equal(np.asarray(buf), np.asarray(fed))
    key = jax.random.key(6)
    _both(jaxmx.quantize_rowwise_colwise, x[:40], "nvfp4", key=key, swizzled_scales=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_mx_tiles(fmt):
    x = jnp.asarray(_corpus_matrix()[:100])  # NaN/inf tiles, every scale edge; 100 x 160
    for tile in [(32, 32), (1, 32), (64, 16)]:
        _both(jaxmx.quantize, x, fmt, -1, "even", tile=tile)
    x = x.astype(jnp.bfloat16).reshape(2, 50, 160)
    _both(jaxmx.quantize, x, fmt, key=jax.random.key(7), tile=(32, 32))


def test_tiles_that_do_not_divide_the_kernel_tile():
    x = jnp.ones((48, 96))
    with pytest.raises(ValueError, match=r"tiles whose sides divide 128, not \(48, 32\)"):
        jaxmx.quantize(x, tile=(48, 32), impl="pallas")
    jaxmx.quantize(x, tile=(48, 32))  # XLA


def test_under_jit():
    x = jnp.asarray(_corpus_matrix()[:64, :64])
    run = jax.jit(lambda x: jaxmx.quantize_rowwise_colwise(x, impl="pallas"))
    _same_bytes(run(x), jaxmx.quantize_rowwise_colwise(x, impl="xla"))


@pytest.mark.parametrize(
    ("fmt", "mode", "tile"),
    [
        *((f, None, (32, 32)) for f in FORMATS),
        ("fp8_e4m3_block", "fp32", (128, 128)),
        ("fp8_e5m2_block", "pow2", (64, 128)),
        ("nvfp4", None, (16, 16)),
    ],
)
def test_kernels_lowered_for_cuda_are_the_interpreted_ones(fmt, mode, tile):
    """Compiled for a GPU the kernels gave other bytes (impl.PALLAS_ON_GPU): a program lowered
    for CUDA from this CPU process (jax.export lowers for a platform it does not run on) holds
    no Triton kernel, whatever the entry point; "auto" is the XLA quantizer there too."""
    x = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)
    swizzled = not fmt.endswith("_block")  # float32 scales have no swizzled layout
    key = jax.random.key(0)
    for fn in (
        lambda x: jaxmx.quantize_rowwise_colwise(
            x, fmt, mode, impl="pallas", swizzled_scales=swizzled
        ),
        lambda x: jaxmx.quantize_rowwise_colwise(x, fmt, mode, key=key, impl="pallas"),
        lambda x: jaxmx.quantize(x, fmt, 0, mode, impl="pallas"),
        lambda x: jaxmx.quantize(x, fmt, -1, mode, impl="pallas"),
        lambda x: jaxmx.quantize(x, fmt, -1, mode, key=key, tile=tile, impl="pallas"),
        lambda x: jaxmx.quantize(x, fmt),
    ):
        module = jax.export.export(jax.jit(fn), platforms=["cuda"])(x).mlir_module()
        assert "triton" not in module


def test_bad_impl(monkeypatch):
    x = jnp.ones((4, 32))
    with pytest.raises(ValueError, match="impl"):
        jaxmx.quantize(x, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        jaxmx.quantize_rowwise_colwise(x, impl=None)
    monkeypatch.setattr(quantize_module.jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match="impl='pallas' runs on the CPU"):
        jaxmx.quantize(x, impl="pallas")
    jaxmx.quantize(x, impl="auto")  # XLA there


def test_compiled_kernels_are_refused_on_a_gpu(monkeypatch):
    """Their first run on a GPU (an H200) gave other bytes than the XLA quantizer: refused there,
    whatever the entry point, with the reason; "auto" and "xla" are unaffected."""
    x = jnp.ones((4, 32))
    monkeypatch.setattr(quantize_module.jax, "default_backend", lambda: "gpu")
    for call in (
        lambda: jaxmx.quantize(x, impl="pallas"),
        lambda: jaxmx.quantize_rowwise_colwise(x, impl="pallas"),
    ):
        with pytest.raises(NotImplementedError, match=r"refused on GPUs.*-0.*use impl='xla'"):
            call()
    jaxmx.quantize(x, impl="auto")


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "nvfp4", "fp8_e4m3_block"])
@pytest.mark.parametrize("shape, axis", [((0, 64), 1), ((0, 64), 0), ((4, 0), 1), ((0,), 0)])
def test_empty_inputs_quantize_like_xla(fmt, shape, axis):
    block = jaxmx.FORMATS[fmt].block
    padded = list(shape)
    padded[axis] = -(-shape[axis] // block) * block
    blocks = list(padded)
    blocks[axis] //= block
    q = jaxmx.quantize(jnp.zeros(shape), fmt, axis=axis, impl="pallas")
    assert q.data.shape == tuple(padded) and q.scale.shape == tuple(blocks)
    _same_bytes(q, jaxmx.quantize(jnp.zeros(shape), fmt, axis=axis, impl="xla"))
    assert jaxmx.dequantize(q).shape == shape


@pytest.mark.parametrize("shape", [(0, 64), (64, 0)])
def test_empty_rowwise_colwise_like_xla(shape):
    copies = jaxmx.quantize_rowwise_colwise(jnp.zeros(shape), impl="pallas")
    assert jaxmx.dequantize(copies.row).shape == shape
    assert jaxmx.dequantize(copies.col_t).shape == shape[::-1]
    _same_bytes(copies, jaxmx.quantize_rowwise_colwise(jnp.zeros(shape), impl="xla"))
    tiled = jaxmx.quantize(jnp.zeros(shape), tile=(32, 32), impl="pallas")
    assert jaxmx.dequantize(tiled).shape == shape
