"""E5M6 (the storage-only format) against a numpy table of its 4096 codes, and
``jaxmx.save_quantized``: gradients equal ``jax.vjp`` of the function at an independently
dequantized input, residuals really 8 / 12 bits, under jit / vmap / scan / remat / nnx, and
refusals by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # in a test only: the residuals' avals
from reference import dequantize as mx_dequantize
from reference import quantize as mx_quantize

import jaxmx
from jaxmx.demo.losses import loss_fn
from jaxmx.demo.train import Config, build_model

# --- an independent E5M6: 1 sign, 5 exponent (bias 15), 6 mantissa bits, IEEE-like ----------


def e5m6_values() -> np.ndarray:
    """float64 value of each of the 4096 codes (inf / NaN in the all-ones exponent)."""
    code = np.arange(4096)
    sign = np.where(code >> 11, -1.0, 1.0)
    exponent, mantissa = (code >> 6) & 0x1F, code & 0x3F
    normal = (1 + mantissa / 64) * 2.0 ** (exponent - 15)
    magnitude = np.where(exponent == 0, mantissa * 2.0**-20, normal)
    magnitude = np.where(exponent == 31, np.where(mantissa == 0, np.inf, np.nan), magnitude)
    return sign * magnitude


VALUES = e5m6_values()
POSITIVE = VALUES[:0x7C0]  # the finite non-negative codes, increasing with the code


def e5m6_codes(v: np.ndarray) -> np.ndarray:
    """Nearest finite code to each float64 ``v`` (|v| <= max), ties to the even code."""
    a = np.abs(v)
    hi = np.clip(np.searchsorted(POSITIVE, a), 1, len(POSITIVE) - 1)
    lo = hi - 1
    d_lo, d_hi = a - POSITIVE[lo], POSITIVE[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.where(np.signbit(v), pick | 0x800, pick).astype(np.uint16)


def e5m6_block_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(uint16 codes, float32 power-of-two scales) of 2-D ``x`` in blocks of 128 on axis -1."""
    blocks = x.astype(np.float64).reshape(x.shape[0], -1, 128)
    amax = np.abs(blocks).max(-1)
    k = np.array([next(k for k in range(-127, 200) if a / 2.0**k <= 65024.0) for a in amax.ravel()])
    scale = np.where(amax.ravel() == 0, 1.0, 2.0**k).reshape(amax.shape)
    codes = e5m6_codes(np.clip(blocks / scale[..., None], -65024.0, 65024.0))
    return codes.reshape(x.shape), scale.astype(np.float32)


def test_e5m6_decode_of_every_code():
    f = jaxmx.FORMATS["e5m6_block"]
    assert (f.bits, f.storage_bits, f.dtype, f.elem_max) == (12, 16, jnp.uint16, 65024.0)
    assert f.elem_max == np.nanmax(VALUES[np.isfinite(VALUES)])
    codes = jnp.arange(4096, dtype=jnp.uint16).reshape(32, 128)
    q = jaxmx.MXArray(codes, jnp.ones((32, 1), jnp.float32), "e5m6_block", 1, (32, 128))
    got = np.asarray(jaxmx.dequantize(q)).ravel().astype(np.float64)
    np.testing.assert_array_equal(got, VALUES)  # NaN where NaN, inf where inf


def test_e5m6_quantize_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 256)) * np.exp2(rng.integers(-30, 30, (6, 1)))
    # exact ties between neighbouring codes, subnormal elements, a zero block, a wide block
    scale = 2.0**3
    ties = (POSITIVE[:-1] + POSITIVE[1:]) / 2 * scale
    x[0, :128] = ties[rng.choice(len(ties), 128)] * rng.choice([-1, 1], 128)
    x[1, :128] = POSITIVE[rng.choice(80, 128)] * 2.0**-20  # subnormal codes after scaling
    x[1, 0] = 65024.0 * 2.0**-20  # sets that block's scale to 2^-20
    x[2, 128:] = 0.0
    x[3, 128:] = np.geomspace(1e-30, 1e30, 128)
    x = x.astype(np.float32)
    codes, scales = e5m6_block_reference(x)
    q = jaxmx.quantize(jnp.asarray(x), "e5m6_block")
    np.testing.assert_array_equal(np.asarray(q.scale), scales)
    np.testing.assert_array_equal(np.asarray(q.data), codes)
    want = VALUES[codes.astype(int)] * np.repeat(scales, 128, axis=1)
    np.testing.assert_array_equal(np.asarray(jaxmx.dequantize(q)), want.astype(np.float32))
    fake = jaxmx.fake_quantize(jnp.asarray(x), "e5m6_block")
    np.testing.assert_array_equal(np.asarray(fake), want.astype(np.float32))


def test_e5m6_refused_where_it_cannot_go():
    with pytest.raises(ValueError, match="e5m6_block is a storage-only format"):
        jaxmx.Recipe(fwd="e5m6_block")
    q = jaxmx.quantize(jnp.ones((128, 128)), "e5m6_block")
    with pytest.raises(ValueError, match="matmul: a: e5m6_block is a storage-only format"):
        jaxmx.matmul(q, q)
    with pytest.raises(ValueError, match=r"e5m6_block.*storage-only"):
        jaxmx.KVCache.create(1, 8, 1, 128, fmt="e5m6_block")
    with pytest.raises(NotImplementedError, match=r"pallas.*e5m6_block"):
        jaxmx.quantize(jnp.ones((4, 128)), "e5m6_block", impl="pallas")
    with pytest.raises(ValueError, match="unknown scale_mode 'fp32' for e5m6_block"):
        jaxmx.quantize(jnp.ones((4, 128)), "e5m6_block", scale_mode="fp32")


# --- save_quantized ----------------------------------------------------------------------------


def block_fp8_reference(x: np.ndarray) -> np.ndarray:
    """fp8_e4m3_block with float32 scales amax / 448, values decoded (float64)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 128)
    s = np.maximum(np.abs(blocks).max(-1, keepdims=True) / np.float32(448), np.float32(2**-126))
    codes = np.clip(blocks / s, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return (codes.astype(np.float32) * s).reshape(x.shape).astype(np.float64)


def reference_decoded(x: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "e5m6_block":
        codes, scales = e5m6_block_reference(x)
        return VALUES[codes.astype(int)] * np.repeat(scales, 128, axis=1)
    if fmt == "fp8_e4m3_block":
        return block_fp8_reference(x)
    data, scale = mx_quantize(x, fmt)
    return mx_dequantize(data, scale, -1, x.shape)


def fn(x, w):
    """A GELU and a norm-like product with a parameter: a non-GEMM function of x."""
    return jax.nn.gelu(x) * w + jnp.tanh(x).mean(-1, keepdims=True)


X = (np.random.default_rng(1).standard_normal((4, 256)) * 3).astype(np.float32)
W = np.linspace(0.5, 1.5, 256, dtype=np.float32)
G = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "fp8_e4m3_block", "e5m6_block"])
def test_gradients_are_fns_at_the_decoded_input(fmt):
    wrapped = jaxmx.save_quantized(fn, fmt)
    out, vjp = jax.vjp(wrapped, X, W)
    np.testing.assert_array_equal(out, fn(X, W))  # the forward pass is fn's, unchanged
    x_hat = jnp.asarray(reference_decoded(X, fmt).astype(np.float32))
    assert not np.array_equal(np.asarray(x_hat), X)  # the quantization is visible
    _, want_vjp = jax.vjp(fn, x_hat, W)
    for got, want in zip(vjp(G), want_vjp(G), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "fmt, code_bytes, scale",
    [
        ("mxfp8_e4m3", 4 * 256, ((4, 8), "float8_e8m0fnu")),
        ("e5m6_block", 4 * 256 * 3 // 2, ((4, 2), "float32")),
    ],
)
def test_residuals_are_8_or_12_bits(fmt, code_bytes, scale):
    x = jnp.asarray(X, jnp.bfloat16)
    wrapped = jaxmx.save_quantized(lambda x: jax.nn.gelu(x), fmt)
    saved = [aval for aval, _ in saved_residuals(lambda x: wrapped(x).sum(), x)]
    shapes = {(a.shape, str(a.dtype)) for a in saved}
    assert shapes == {((code_bytes,) if fmt == "e5m6_block" else (4, 256), "uint8"), scale}
    plain = [aval for aval, _ in saved_residuals(lambda x: jax.nn.gelu(x).sum(), x)]
    assert any(a.dtype == jnp.bfloat16 and a.shape == (4, 256) for a in plain)


def test_under_jit_vmap_scan_and_remat():
    # products only: each program rounds the same three products, in whatever order it fuses
    # them (a few float32 ulps: rtol 4 * 2^-24 per product chain)
    def product(x, w):
        return x * x * w

    wrapped = jaxmx.save_quantized(product, "e5m6_block")

    def loss(x, w):
        return (wrapped(x, w) * G).sum()

    want = jax.grad(loss, argnums=(0, 1))(X, W)
    x_hat = reference_decoded(X, "e5m6_block")
    np.testing.assert_allclose(want[0], 2 * x_hat * W * G, rtol=2.5e-7)
    rows = jax.jit(jax.vmap(jax.grad(lambda x, g: (wrapped(x, W) * g).sum())))(X, G)

    def step(carry, xg):
        x, g = xg
        return carry + (wrapped(x, W) * g).sum(), None

    got = {
        "jit": jax.jit(jax.grad(loss))(X, W),
        "remat": jax.jit(jax.grad(jax.checkpoint(loss)))(X, W),
        "vmap": rows,
        "scan": jax.jit(jax.grad(lambda x: jax.lax.scan(step, 0.0, (x, G))[0]))(X),
    }
    for name, g in got.items():
        np.testing.assert_allclose(g, want[0], rtol=2.5e-7, err_msg=name)


def test_demo_model_with_saved_activations():

    cfg = Config(d_model=32, layers=1, heads=1, seq_len=16, batch=2)
    tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16)
    step = nnx.jit(nnx.value_and_grad(loss_fn))
    loss, grads = step(build_model(cfg), tokens, tokens)
    saved = build_model(cfg.__class__(**{**cfg.__dict__, "save_activations": "mxfp8_e4m3"}))
    loss_q, grads_q = step(saved, tokens, tokens)
    assert loss_q == loss  # the forward pass is unchanged
    flat, flat_q = jax.tree.leaves(grads), jax.tree.leaves(grads_q)
    assert all(bool(jnp.isfinite(g).all()) for g in flat_q) and len(flat) == len(flat_q)


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="fmt 'nvfp4' is not a format activations are saved"):
        jaxmx.save_quantized(fn, "nvfp4")
    with pytest.raises(TypeError, match=r"argument 0 .* dtype int32"):
        jaxmx.save_quantized(fn)(jnp.ones((4, 32), jnp.int32), W)
    with pytest.raises(ValueError, match="argnums"):
        jaxmx.save_quantized(fn, argnums=-1)
    with pytest.raises(ValueError, match="names argument 2"):
        jaxmx.save_quantized(fn, argnums=2)(X, W)
    with pytest.raises(ValueError, match="unknown scale_mode 'fp32' for mxfp8_e4m3"):
        jaxmx.save_quantized(fn, "mxfp8_e4m3", scale_mode="fp32")
