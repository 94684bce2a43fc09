"""Quantization and the CPU GEMMs under ``jax.vmap`` give the bits of a loop over the slices.

XLA turns a division by a broadcast divisor into a multiplication by its rounded reciprocal;
under vmap an unbatched divisor was broadcast after ``bits.divide``'s barrier (issue 23).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmx

STACK = 40


def stack(shape=(8, 256), seed=0) -> np.ndarray:
    """STACK slices whose magnitudes vary over many binades (so their amax do as well)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((STACK, *shape)).astype(np.float32)
    return x * np.float32(2.0) ** rng.integers(-20, 20, (STACK, 1, 1)).astype(np.float32)


def bits_of(x) -> np.ndarray:
    """The raw bytes of an array, as unsigned integers of its item size."""
    x = np.asarray(x)
    return x.view({1: np.uint8, 4: np.uint32}[x.dtype.itemsize])


def assert_same_bits(a, b):
    np.testing.assert_array_equal(bits_of(a), bits_of(b))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3_block"])
def test_vmapped_quantize_equals_a_loop(fmt):
    x = jnp.asarray(stack())
    batched = jax.vmap(lambda t: jaxmx.quantize(t, fmt))(x)
    for i in range(STACK):
        q = jaxmx.quantize(x[i], fmt)
        assert_same_bits(batched.data[i], q.data)
        assert_same_bits(batched.scale[i], q.scale)
        if q.global_scale is not None:
            assert_same_bits(batched.global_scale[i], q.global_scale)


def test_vmapped_nvfp4_tensor_scale_is_the_float32_quotient():
    """g = amax / (448 * 6), the numpy float32 quotient (IEEE, round to nearest even)."""
    x = stack()
    g = jax.vmap(lambda t: jaxmx.quantize(t, "nvfp4").global_scale)(jnp.asarray(x))
    amax = np.max(np.abs(x), axis=(1, 2))
    want = np.maximum(amax / np.float32(448.0 * 6.0), np.float32(2.0**-126))
    assert_same_bits(g, want)


def test_vmapped_block_fp8_scales_are_the_float32_quotients():
    """s = amax / 448 per 1x128 block, the numpy float32 quotient."""
    x = stack()
    s = jax.vmap(lambda t: jaxmx.quantize(t, "fp8_e4m3_block").scale)(jnp.asarray(x))
    amax = np.max(np.abs(x.reshape(STACK, 8, 2, 128)), axis=-1)
    assert_same_bits(s, np.maximum(amax / np.float32(448.0), np.float32(2.0**-126)))


@pytest.mark.parametrize(
    "fmt, gemm", [("nvfp4", jaxmx.ffi.fp4_matmul), ("fp8_e4m3_block", jaxmx.ffi.block_fp8_matmul)]
)
def test_vmapped_cpu_gemm_equals_a_loop(fmt, gemm):
    a, b = jnp.asarray(stack((4, 256), 1)), jnp.asarray(stack((8, 256), 2))

    def step(x, w):
        return gemm(jaxmx.quantize(x, fmt), jaxmx.quantize(w, fmt), jnp.float32)

    batched = jax.vmap(step)(a, b)
    for i in range(STACK):
        assert_same_bits(batched[i], step(a[i], b[i]))
