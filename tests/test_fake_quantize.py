"""jaxmx.fake_quantize and the emulated GEMM's code-free operands.

``fake_quantize`` must equal ``dequantize(quantize(x))`` bit for bit: checked exhaustively over
every bfloat16 input under every scale exponent, against the independent reference of
``tests/reference.py`` on the quantizer tests' corpus, and against jaxmx's own quantizer (whose
bytes tests/test_quantize.py checks against the reference) for stochastic rounding, axes,
padding and dtypes. ``jaxmx.dot_general`` on the emulation feeds GEMMs with element values
instead of codes: its results must equal the GEMMs of the quantized copies, bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference as ref
from test_quantize import CORPUS, FORMATS, MODES, assert_same_float32

import jaxmx
from jaxmx._src.gemm.emulate import emulated_matmul
from jaxmx._src.quantize.fake import quantize_to_grid
from jaxmx._src.training import scope

ALL = [(f, m) for f in FORMATS for m in MODES]


@functools.partial(jax.jit, static_argnames=("fmt", "axis", "scale_mode", "dtype"))
def _both(x, fmt, axis=-1, scale_mode="rceil", key=None, dtype=jnp.float32):
    """(fake_quantize(x), dequantize(quantize(x)))."""
    q = jaxmx.quantize(x, fmt, axis, scale_mode, key=key)
    fake = jaxmx.fake_quantize(x, fmt, axis, scale_mode, key=key, dtype=dtype)
    return fake, jaxmx.dequantize(q, dtype)


def _assert_same_bits(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = np.isnan(expected.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(actual.astype(np.float32)), nan)
    a = actual.view(f"u{actual.itemsize}")[~nan]
    e = expected.view(f"u{expected.itemsize}")[~nan]
    bad = np.nonzero(a != e)[0]
    assert bad.size == 0, f"{bad.size} mismatches, first: {actual[~nan][bad[:5]]} vs {e[bad[:5]]}"


def _every_bf16_under_every_scale() -> np.ndarray:
    """[n, 32] float32 blocks: an anchor 1.75 * 2^a (a = -134 .. 127: every scale byte from 0
    up to that of the largest float32, in every format and mode) followed by 31 bfloat16
    values, all 65536 bit patterns under each anchor (values above it set a larger scale)."""
    every = np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    rows = -(-every.size // 31)
    values = np.zeros(rows * 31, np.float32)
    values[: every.size] = every
    values = values.reshape(rows, 31)
    blocks = []
    for a in range(-134, 128):
        anchor = np.float32(1.75 * 2.0**a) if a < 127 else np.float32(1.5 * 2.0**127)
        blocks.append(np.concatenate([np.full((rows, 1), anchor, np.float32), values], 1))
    return np.concatenate(blocks)


@pytest.mark.parametrize(("fmt", "mode"), ALL)
def test_exhaustive_bf16_every_scale(fmt, mode):
    x = jnp.asarray(_every_bf16_under_every_scale())
    fake, want = _both(x, fmt, scale_mode=mode)
    _assert_same_bits(fake, want)
    scales = np.unique(np.asarray(jaxmx.quantize(x, fmt, scale_mode=mode).scale).view(np.uint8))
    finite = scales[scales != 255]  # every scale byte from 0 up to that of the largest bf16
    top = 254 - jaxmx.FORMATS[fmt].emax - 1
    assert finite.min() == 0 and finite.max() >= top and finite.size == finite.max() + 1


@pytest.mark.parametrize(("fmt", "mode"), ALL)
def test_corpus_matches_reference(fmt, mode):
    fake = jax.jit(jaxmx.fake_quantize, static_argnums=(1, 2, 3))(
        jnp.asarray(CORPUS), fmt, -1, mode
    )
    data, scale = ref.quantize(CORPUS, fmt, mode, -1)
    assert_same_float32(fake, ref.dequantize(data, scale, 1, CORPUS.shape))


@pytest.mark.parametrize(
    ("shape", "axis", "dtype"),
    [
        ((33, 70), 0, np.float32),
        ((33, 70), 1, ml_dtypes.bfloat16),
        ((3, 40, 5), 1, np.float16),
        ((2, 3, 64), -1, ml_dtypes.bfloat16),
        ((100,), 0, np.float32),
    ],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_axes_padding_dtypes(shape, axis, dtype, fmt):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(shape) * 2.0 ** rng.integers(-12, 12, shape)).astype(dtype)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        fake, want = _both(jnp.asarray(x), fmt, axis=axis, dtype=out_dtype)
        assert fake.shape == shape
        _assert_same_bits(fake, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_stochastic_rounding_same_draws_as_quantize(fmt):
    x = jnp.asarray(np.concatenate([CORPUS[:64], CORPUS[-64:]]))
    for seed in (0, 1):
        fake, want = _both(x, fmt, key=jax.random.key(seed))
        _assert_same_bits(fake, want)
    nearest, _ = _both(x, fmt)
    assert (np.asarray(fake) != np.asarray(nearest)).any()  # the key changed something


def test_bad_input():
    x = jnp.ones((4, 32))
    with pytest.raises(ValueError, match="format"):
        jaxmx.fake_quantize(x, "mxfp6")
    with pytest.raises(ValueError, match="scale_mode"):
        jaxmx.fake_quantize(x, scale_mode="nearest")
    with pytest.raises(TypeError, match="dtype"):
        jaxmx.fake_quantize(jnp.ones((4, 32), jnp.int32))
    with pytest.raises(TypeError, match="dtype"):
        jaxmx.fake_quantize(x, dtype=jnp.int8)
    with pytest.raises(ValueError, match="out of range"):
        jaxmx.fake_quantize(x, axis=2)
    with pytest.raises(TypeError, match="key"):
        jaxmx.fake_quantize(x, key=jnp.zeros((3,)))


# --- the emulated GEMM on element values ---------------------------------------------------


def test_emulated_matmul_on_grid_operands_equals_codes():
    """Wide-range rows (scales 2^-127 .. 2^127, NaN blocks, padding): the same bits either way."""
    rng = np.random.default_rng(7)
    a = CORPUS[rng.permutation(len(CORPUS))[:320]].reshape(32, 320)[:, :300]
    b = CORPUS[rng.permutation(len(CORPUS))[:320]].reshape(32, 320)[:, :300]
    for fmt in FORMATS:
        qa, qb = (jaxmx.quantize(jnp.asarray(v), fmt) for v in (a, b))
        ga, gb = (quantize_to_grid(jnp.asarray(v), fmt) for v in (a, b))
        _assert_same_bits(
            emulated_matmul(ga, gb, jnp.float32), emulated_matmul(qa, qb, jnp.float32)
        )


@pytest.mark.parametrize("rounded", ["nearest", "stochastic"])
def test_nvfp4_quantized_to_grid_values_are_its_decoded_codes(rounded):
    """NVFP4 held as element values (the emulated GEMM's operands since the values path took
    it): the values are the E2M1 codes decoded by ml_dtypes, -0 included, with the same E4M3
    block scales and tensor scale; the GEMM on them equals the GEMM on the codes."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((8, 96)) * np.exp2(rng.integers(-8, 8, (8, 1)))).astype(np.float32)
    x[2, :16] = 0.0  # an all-zero block
    x[5, 20] = -1e-30  # rounds to -0 in its block
    key = jax.random.key(4) if rounded == "stochastic" else None
    q = jaxmx.quantize(jnp.asarray(x), "nvfp4", key=key)
    g = quantize_to_grid(jnp.asarray(x), "nvfp4", key=key)
    want = np.asarray(q.data).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert_same_float32(np.asarray(g.data), want)
    assert np.array_equal(np.asarray(g.scale).view(np.uint8), np.asarray(q.scale).view(np.uint8))
    assert np.asarray(g.global_scale) == np.asarray(q.global_scale)
    w = quantize_to_grid(jnp.asarray(x[::-1].copy()), "nvfp4")
    qw = jaxmx.quantize(jnp.asarray(x[::-1].copy()), "nvfp4")
    _assert_same_bits(emulated_matmul(g, w, jnp.float32), emulated_matmul(q, qw, jnp.float32))


def _copies_reference(x, w, g, recipe, key):
    """y, dx, dw from explicitly quantized copies (codes) and the emulated GEMM."""
    q = functools.partial(jaxmx.quantize, scale_mode=recipe.scale_mode)
    row_key, col_key = scope.copy_keys(key)
    y = emulated_matmul(q(x, recipe.fwd, -1), q(w, recipe.fwd, -1), jnp.float32)
    dx = emulated_matmul(q(g, recipe.grad, -1, key=row_key), q(w, recipe.fwd, -2), jnp.float32)
    dw = emulated_matmul(q(g, recipe.grad, -2, key=col_key), q(x, recipe.fwd, -2), jnp.float32)
    return y, dx, dw


@pytest.mark.parametrize("residuals", ["quantized", "high_precision"])
@pytest.mark.parametrize(
    ("fwd", "grad", "rounding"),
    [
        ("mxfp8_e4m3", "mxfp8_e4m3", "nearest"),
        ("mxfp8_e4m3", "mxfp8_e5m2", "stochastic"),
        ("mxfp4", "mxfp4", "stochastic"),
    ],
)
def test_dot_general_equals_gemms_of_the_copies(fwd, grad, rounding, residuals):
    recipe = jaxmx.Recipe(
        fwd=fwd, grad=grad, backend="emulate", residuals=residuals, grad_rounding=rounding
    )
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((64, 96)) * 3, jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 96)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((64, 40)) * 1e-3, jnp.float32)
    key = jax.random.key(3) if rounding == "stochastic" else None

    def y_of(x, w):
        return jaxmx.dot_general(
            x,
            w,
            (((1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32,
            recipe=recipe,
            key=key,
        )

    y, vjp = jax.vjp(jax.jit(y_of), x, w)
    dx, dw = vjp(g)
    want_y, want_dx, want_dw = _copies_reference(x[None], w[None], g[None], recipe, key)
    _assert_same_bits(y, want_y[0])
    _assert_same_bits(dx, want_dx[0])
    _assert_same_bits(dw, want_dw[0])
