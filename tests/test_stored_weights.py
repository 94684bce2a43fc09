"""Weights at rest without Flax: ``jaxmx.store_weight`` and ``jaxmx.weight_matmul``.

The stored codes and scales are checked against the reference quantizer (``reference.py``), the
GEMM against a float64 product of the stored weight decoded here with ml_dtypes, within the
rounding of float32 accumulation (and of a bfloat16 result); then each refusal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference as ref

import jaxmx

K, N = 128, 48
U = 2.0**-24  # float32 unit roundoff
FORMATS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"]  # MX formats: element codes and E8M0 scales


def _kernel(shape=(K, N), seed=0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _decoded(w) -> np.ndarray:
    """The ``[N, K]`` MX weight decoded in float64 from its codes and E8M0 scales (ml_dtypes)."""
    codes = np.asarray(w.data).astype(np.float64)
    scales = np.asarray(w.scale).view(np.uint8).astype(np.int64)
    assert np.asarray(w.scale).dtype == ml_dtypes.float8_e8m0fnu
    return codes * np.ldexp(1.0, np.repeat(scales, 32, axis=1) - 127)


def _bound(x: np.ndarray, w_hat: np.ndarray) -> np.ndarray:
    """The float32 accumulation bound of ``x @ w_hat.T`` (``K`` terms)."""
    return (x.shape[-1] + 2) * U * (np.abs(x) @ np.abs(w_hat).T)


@pytest.mark.parametrize("fmt", FORMATS)
def test_store_weight_is_the_reference_quantization_along_k(fmt):
    kernel = _kernel()
    w = jaxmx.store_weight(kernel, fmt)
    data, scale = ref.quantize(np.asarray(kernel).T, fmt, axis=-1)
    assert (w.shape, w.axis, w.fmt) == ((N, K), 1, fmt)
    np.testing.assert_array_equal(np.asarray(w.data).astype(np.float64), data.astype(np.float64))
    np.testing.assert_array_equal(np.asarray(w.scale).view(np.uint8), scale)


def test_store_weight_flattens_the_contracting_dims():
    kernel = _kernel((4, 32, N))  # [*in, N], K = 4 * 32
    w = jaxmx.store_weight(kernel, "mxfp8_e4m3", contracting=2)
    data, scale = ref.quantize(np.asarray(kernel).reshape(K, N).T, "mxfp8_e4m3", axis=-1)
    assert w.shape == (N, K)
    np.testing.assert_array_equal(np.asarray(w.data).astype(np.float64), data.astype(np.float64))
    np.testing.assert_array_equal(np.asarray(w.scale).view(np.uint8), scale)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_weight_only_is_x_times_the_decoded_weight(fmt, dtype):
    w = jaxmx.store_weight(_kernel(), fmt)
    x = jax.random.normal(jax.random.key(1), (3, 5, K), jnp.float32).astype(dtype)
    y = jaxmx.weight_matmul(x, w)
    assert (y.shape, y.dtype) == ((3, 5, N), jnp.dtype(dtype))
    x64, w_hat = np.asarray(x, np.float64), _decoded(w)  # w_hat exact in bfloat16 (MX)
    y_ref = x64 @ w_hat.T
    r = 2.0**-8 if dtype == jnp.bfloat16 else 0.0  # the bfloat16 result's rounding
    bound = _bound(x64, w_hat) * (1 + r) + r * np.abs(y_ref)
    assert np.all(np.abs(np.asarray(y, np.float64) - y_ref) <= bound)


def test_the_result_dtype_is_dtype():
    w = jaxmx.store_weight(_kernel(), "mxfp8_e4m3")
    x = jax.random.normal(jax.random.key(1), (4, K), jnp.bfloat16)
    y = jaxmx.weight_matmul(x, w, dtype=jnp.float32)
    assert y.dtype == jnp.float32
    x64, w_hat = np.asarray(x, np.float64), _decoded(w)
    assert np.all(np.abs(np.asarray(y, np.float64) - x64 @ w_hat.T) <= _bound(x64, w_hat))


@pytest.mark.parametrize("fmt", FORMATS)
def test_activations_is_the_product_of_quantized_operands(fmt):
    w = jaxmx.store_weight(_kernel(), fmt)
    x = jax.random.normal(jax.random.key(2), (2, 3, K), jnp.float32)
    y = jaxmx.weight_matmul(x, w, activations=True, dtype=jnp.float32)
    data, scale = ref.quantize(np.asarray(x), fmt, axis=-1)
    x_hat = ref.dequantize(data, scale, -1, x.shape)
    w_hat = _decoded(w)
    y_ref = x_hat @ w_hat.T
    assert y.shape == (2, 3, N)
    assert np.all(np.abs(np.asarray(y, np.float64) - y_ref) <= _bound(x_hat, w_hat))
    assert not np.allclose(x_hat, np.asarray(x))  # the activation was quantized


@pytest.mark.parametrize("activations", [False, True])
def test_a_gradient_is_refused(activations):
    w = jaxmx.store_weight(_kernel(), "mxfp8_e4m3")
    x = jnp.ones((2, K))

    def loss(x):
        return jaxmx.weight_matmul(x, w, activations=activations).sum()

    with pytest.raises(TypeError, match=r"weight_matmul: .* \(forward only\) and has no gradient"):
        jax.grad(loss)(x)


def test_a_wrong_k_names_both_shapes():
    w = jaxmx.store_weight(_kernel(), "mxfp8_e4m3")
    with pytest.raises(
        ValueError, match=r"x \[\.\.\., K\] of shape \(2, 96\) .* \[N, K\] of shape"
    ):
        jaxmx.weight_matmul(jnp.ones((2, 96)), w)
    with pytest.raises(ValueError, match=rf"\(2, 96\).*\({N}, {K}\)"):
        jaxmx.weight_matmul(jnp.ones((2, 96)), w)


def test_a_non_float_input_or_dtype_is_refused():
    w = jaxmx.store_weight(_kernel(), "mxfp8_e4m3")
    with pytest.raises(TypeError, match="x must be a floating-point array, got int32"):
        jaxmx.weight_matmul(jnp.ones((2, K), jnp.int32), w)
    with pytest.raises(TypeError, match="dtype must be floating point, got int32"):
        jaxmx.weight_matmul(jnp.ones((2, K)), w, dtype=jnp.int32)


def test_a_weight_not_stored_along_k_is_refused():
    with pytest.raises(TypeError, match=r"w must be the MXArray of jaxmx\.store_weight, got"):
        jaxmx.weight_matmul(jnp.ones((2, K)), jnp.ones((N, K)))
    along_n = jaxmx.quantize(jnp.ones((K, 64)), "mxfp8_e4m3", axis=0)
    with pytest.raises(ValueError, match=r"quantized along K \(axis 1\).*along axis 0"):
        jaxmx.weight_matmul(jnp.ones((2, K)), along_n)


def test_store_weight_refuses_bad_arguments():
    with pytest.raises(ValueError, match="contracting must be between 1 and the kernel's rank 2"):
        jaxmx.store_weight(_kernel(), "mxfp8_e4m3", contracting=3)
    with pytest.raises(TypeError, match="contracting must be an int"):
        jaxmx.store_weight(_kernel(), "mxfp8_e4m3", contracting=1.0)
    with pytest.raises(ValueError, match="store_weight: fmt: e5m6_block is a storage-only"):
        jaxmx.store_weight(_kernel(), "e5m6_block")
