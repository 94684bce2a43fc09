"""The modelled limited-precision accumulator (Recipe.accum_bits), against a numpy model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmx


def truncating_accumulation(a, b, kept_bits, promote_every=None, step=32):
    """numpy: a [m, k] @ b [n, k]^T, summing steps of 32 products with the running sum, each
    truncated toward zero to kept_bits below the largest exponent (float64 is exact here)."""
    products = a[:, None, :] * b[None, :, :]
    k = products.shape[-1]
    promote_every = promote_every or -(-k // step) * step
    total = np.zeros(products.shape[:-1], np.float32)
    partial = np.zeros(products.shape[:-1])
    for start in range(0, k, step):
        values = np.concatenate([partial[..., None], products[..., start : start + step]], -1)
        _, exponent = np.frexp(np.abs(values).max(-1, keepdims=True))
        quantum = np.ldexp(1.0, exponent - kept_bits)
        partial = (np.trunc(values / quantum) * quantum).sum(-1)
        if (start + step) % promote_every == 0 or start + step >= k:
            total = total + partial.astype(np.float32)
            partial = np.zeros_like(partial)
    return total


def test_a_product_below_the_kept_bits_is_dropped():
    """32 ones, then 2^-20 among 31 more ones: aligned to the running sum 32 = 2^5 (exponent 6),
    14 bits keep multiples of 2^-8, so 2^-20 is truncated away; float32 accumulation keeps it."""
    a = jaxmx.quantize(jnp.ones((1, 64)).at[0, 32].set(2.0**-20))
    b = jaxmx.quantize(jnp.ones((1, 64)))
    assert jaxmx.matmul(a, b, jnp.float32, accum_bits=14).item() == 63.0
    assert jaxmx.matmul(a, b, jnp.float32).item() == np.float32(63 + 2.0**-20)


@pytest.mark.parametrize("kept_bits, promote_every", [(14, None), (14, 128), (8, 32), (18, 64)])
@pytest.mark.parametrize("k", [256, 100])  # 100: a partial last block, zero-padded
def test_matmul_equals_the_numpy_model(kept_bits, promote_every, k):
    ka, kb = jax.random.split(jax.random.key(k + kept_bits))
    x = jax.random.uniform(ka, (2, 16, k)) * jnp.exp2(jax.random.randint(ka, (2, 16, 1), -8, 8))
    w = jax.random.normal(kb, (2, 8, k))
    qx, qw = jaxmx.quantize(x), jaxmx.quantize(w)
    got = jaxmx.matmul(qx, qw, jnp.float32, accum_bits=kept_bits, promote_every=promote_every)
    x_values, w_values = (np.asarray(jaxmx.dequantize(q), np.float64) for q in (qx, qw))
    for i in range(2):
        want = truncating_accumulation(
            x_values[i],
            w_values[i],
            kept_bits,
            promote_every,
        )
        np.testing.assert_array_equal(np.asarray(got[i]), want)


def test_a_k_first_operand_is_contracted_in_place():
    x = jax.random.normal(jax.random.key(0), (64, 16))  # [K, M], quantized along K
    w = jax.random.normal(jax.random.key(1), (8, 64))
    qx, qw = jaxmx.quantize(x, axis=0), jaxmx.quantize(w)
    got = jaxmx.matmul(qx, qw, jnp.float32, accum_bits=10)
    want = truncating_accumulation(
        np.asarray(jaxmx.dequantize(qx), np.float64).T,
        np.asarray(jaxmx.dequantize(qw), np.float64),
        10,
    )
    np.testing.assert_array_equal(np.asarray(got), want)


def test_dot_general_runs_every_gemm_through_the_model():
    """The recipe option reaches the forward GEMM (numpy model on the quantized operands) and the
    backward ones (their results move away from float32 accumulation)."""
    x = jax.random.uniform(jax.random.key(0), (32, 2048))
    w = jax.random.uniform(jax.random.key(1), (16, 2048))
    dims = (((1,), (1,)), ((), ()))
    recipe = jaxmx.Recipe(accum_bits=10)
    y = jaxmx.dot_general(x, w, dims, preferred_element_type=jnp.float32, recipe=recipe)
    want = truncating_accumulation(
        np.asarray(jaxmx.dequantize(jaxmx.quantize(x)), np.float64),
        np.asarray(jaxmx.dequantize(jaxmx.quantize(w)), np.float64),
        10,
    )
    np.testing.assert_array_equal(np.asarray(y), want)

    def loss(x, w, recipe):
        return jaxmx.dot_general(x, w, dims, recipe=recipe).sum()

    limited = jax.grad(loss, argnums=(0, 1))(x, w, recipe)
    exact = jax.grad(loss, argnums=(0, 1))(x, w, jaxmx.recipes.MXFP8)
    for got, ref in zip(limited, exact, strict=True):
        assert got.shape == ref.shape and not np.array_equal(got, ref)


def test_bad_accumulator_settings():
    with pytest.raises(ValueError, match=r"accum_bits must be an integer in \[1, 18\]"):
        jaxmx.Recipe(accum_bits=24)
    with pytest.raises(ValueError, match="promote_every needs accum_bits"):
        jaxmx.Recipe(promote_every=128)
    with pytest.raises(ValueError, match="positive multiple of 32"):
        jaxmx.Recipe(accum_bits=14, promote_every=100)
    with pytest.raises(ValueError, match="emulation only"):
        jaxmx.Recipe(accum_bits=14, backend="ffi")
    q = jaxmx.quantize(jnp.ones((4, 64)))
    with pytest.raises(ValueError, match="emulation only"):
        jaxmx.matmul(q, q, accum_bits=14, backend="ffi")
    with pytest.raises(NotImplementedError, match="grouped GEMMs"):
        jaxmx.ragged_dot(
            jnp.ones((4, 64)),
            jnp.ones((1, 64, 8)),
            jnp.array([4]),
            recipe=jaxmx.Recipe(accum_bits=14),
        )
