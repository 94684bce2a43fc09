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


# (a code, b code, a scale byte, b scale byte): e4m3 subnormal codes (2^-9, 3 * 2^-9) and scales
# as small as 2^-127; each exact result is a float32 subnormal or underflows to zero, some of
# them between two subnormals (4.375 and 2.5, a tie, units of 2^-149).
TINY = [
    (2.0**-9, 2.0**-9, 60, 60),
    (3 * 2.0**-9, 7 * 2.0**-9, 60, 60),
    (448.0, 2.0**-9, 60, 60),
    (2.0**-9, 2.0**-9, 0, 127),
    (3 * 2.0**-9, 7 * 2.0**-9, 0, 127),
    (1.75, 1.25, 50, 50),
    (1.25, 1.0, 50, 51),
    (2.0**-9, 2.0**-9, 10, 10),
    (2.0**-9, 2.0**-9, 0, 0),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", TINY)
def test_subnormal_results_are_the_exact_product_rounded_once(backend, case):
    a_code, b_code, a_byte, b_byte = case
    a = mx(np.full((2, 32), a_code), [[a_byte], [a_byte]])
    b = mx(np.full((3, 32), b_code), [[b_byte]] * 3)
    want = exact_mx_product(a, b).astype(np.float32)  # numpy rounds once, subnormals kept
    got = np.asarray(jaxmx.matmul(a, b, jnp.float32, backend=backend))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_ffi_and_emulate_agree_on_subnormal_results_of_several_blocks():
    """Each block's result is a float32 subnormal, exact: both backends give their sum."""
    codes = np.full((2, 96), 2.0**-9)
    a = mx(codes, [[40, 60, 127], [60, 61, 0]])
    b = mx(codes[:1], [[80, 60, 0]])
    want = exact_mx_product(a, b).astype(np.float32)
    assert (np.abs(want) < np.finfo(np.float32).tiny).all() and (want != 0).all()
    for backend in BACKENDS:
        got = np.asarray(jaxmx.matmul(a, b, jnp.float32, backend=backend))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
