"""The emulated GEMM agrees with the MX definition (and the native GEMM) near float32's limits."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxmx

BACKENDS = ("emulate", "ffi")


def exact_mx_product(a: jaxmx.MXArray, b: jaxmx.MXArray) -> np.ndarray:
    """float64 reference: decode codes x 2^(byte - 127) per block, then a float64 dot."""

    def decode(q):
        codes = np.asarray(q.data).astype(np.float64)
        byte = np.asarray(q.scale).view(np.uint8).astype(np.int64)
        return codes * np.ldexp(1.0, np.repeat(byte, 32, axis=-1) - 127)

    return decode(a) @ decode(b).T


def mx(codes, byte, fmt=ml_dtypes.float8_e4m3fn, name="mxfp8_e4m3"):
    """A hand-built [rows, 32 * blocks] MXArray from codes and scale bytes."""
    codes = np.asarray(codes, np.float32).astype(fmt)
    scale = np.asarray(byte, np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return jaxmx.MXArray(jnp.asarray(codes), jnp.asarray(scale), name, 1, codes.shape)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_block_past_float32_range_times_a_tiny_one(backend):
    """3.4e38 quantizes to 256 x 2^120 = 2^128 (not a float32); times 2^-100 it is 2^33."""
    big = jaxmx.quantize(jnp.full((1, 32), 3.4e38, jnp.float32))
    tiny = jaxmx.quantize(jnp.full((1, 32), 2.0**-100, jnp.float32))
    assert np.asarray(big.scale).view(np.uint8).item() == 127 + 120
    assert exact_mx_product(big, tiny).item() == 2.0**33
    assert jaxmx.matmul(big, tiny, jnp.float32, backend=backend).item() == 2.0**33


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("byte", [254, 252, 248])
def test_the_largest_scales_with_small_partners(backend, byte):
    rng = np.random.default_rng(byte)
    a_codes = rng.choice([448.0, -320.0, 1.0, 0.5, 0.0], (4, 64))
    b_codes = rng.choice([448.0, 3.0, -2.0, 0.0], (8, 64))
    a = mx(a_codes, np.full((4, 2), byte))  # elements up to 448 x 2^127: past float32
    b = mx(b_codes, np.full((8, 2), 127 - 120))  # 2^-120
    want = exact_mx_product(a, b)
    assert 448.0 * 2.0 ** (byte - 127) > float(np.finfo(np.float32).max)  # not a float32
    assert np.all(np.isfinite(want))
    got = np.asarray(jaxmx.matmul(a, b, jnp.float32, backend=backend), np.float64)
    np.testing.assert_allclose(got, want, rtol=2.0**-20)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_overflow_in_the_exact_result_are_inf(backend):
    a = mx(np.full((1, 32), 448.0), [[254]])
    b = mx(np.full((1, 32), 448.0), [[200]])
    assert (exact_mx_product(a, b) > float(np.finfo(np.float32).max)).all()
    assert np.isinf(np.asarray(jaxmx.matmul(a, b, jnp.float32, backend=backend))).all()


def test_ordinary_inputs_are_untouched_by_the_range_shift():
    """Scales far from the limits: the emulation is the float32 dot of the exact decodes."""
    rng = np.random.default_rng(1)
    a = jaxmx.quantize(jnp.asarray(rng.standard_normal((16, 96)) * 1e3, jnp.float32))
    b = jaxmx.quantize(jnp.asarray(rng.standard_normal((8, 96)), jnp.float32))
    direct = np.asarray(jaxmx.dequantize(a)) @ np.asarray(jaxmx.dequantize(b)).T  # float32
    got = jaxmx.matmul(a, b, jnp.float32, backend="emulate")
    np.testing.assert_allclose(got, direct, rtol=1e-6)


@pytest.mark.parametrize(
    "name, fmt",
    [
        ("mxfp8_e4m3", ml_dtypes.float8_e4m3fn),
        ("mxfp8_e5m2", ml_dtypes.float8_e5m2),
        ("mxfp4", ml_dtypes.float4_e2m1fn),
    ],
)
def test_every_element_reaches_the_gemm_exactly(name, fmt):
    """Each finite code times its block scale, relative to its row's largest scale, enters the
    dot unrounded: a product with the identity gives back every decoded element exactly."""
    codes = np.arange(1 << ml_dtypes.finfo(fmt).bits, dtype=np.uint8)
    values = codes.view(fmt).astype(np.float64)
    values = values[np.isfinite(values)]
    k = 64
    rows = -(-values.size // k)
    a_codes = np.resize(values, rows * k).reshape(rows, k)
    a_bytes = np.tile([[127 + 20, 127 - 40]], (rows, 1))  # the second block 2^-60 below the row max
    a = mx(a_codes, a_bytes, fmt, name)
    identity = mx(np.eye(k), np.full((k, 2), 127), fmt, name)
    got = np.asarray(jaxmx.matmul(a, identity, jnp.float32, backend="emulate"), np.float64)
    np.testing.assert_array_equal(got, exact_mx_product(a, identity))
