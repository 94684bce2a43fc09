"""jaxmx.dot_product_attention against an MX reference (numpy) and jax.nn.dot_product_attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import jaxmx


def qdq(x, axis):
    """x quantized to MXFP8 E4M3 (rceil) along ``axis`` and decoded, by tests/reference.py."""
    x = np.asarray(x, np.float32)
    data, scale = ref.quantize(x, "mxfp8_e4m3", "rceil", axis=axis)
    return ref.dequantize(data, scale, axis, x.shape)


def inputs(b=2, t=32, s=32, n=4, k=2, h=32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, h))
    kk = jax.random.normal(keys[1], (b, s, k, h))
    v = jax.random.normal(keys[2], (b, s, k, h))
    bias = 0.5 * jax.random.normal(keys[3], (1, n, t, s))
    return q, kk, v, bias


def reference_attention(q, k, v, bias, mask, is_causal):
    """MX attention from the definition: Q and K quantized along H, P and V along S."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    qg = qdq(q, -1).reshape(b, t, kh, g, h)
    logits = np.einsum("btkgh,bskh->bkgts", qg, qdq(k, -1)) / np.sqrt(h)
    logits = logits.astype(np.float32)
    keep = np.ones((b, n, t, s), bool)
    if bias is not None:
        logits = logits + np.broadcast_to(bias, (b, n, t, s)).reshape(logits.shape)
    if mask is not None:
        keep &= np.broadcast_to(mask, keep.shape)
    if is_causal:
        keep &= np.tril(np.ones((t, s), bool))
    logits = np.where(keep.reshape(logits.shape), logits, -0.7 * np.finfo(np.float32).max)
    logits = logits - logits.max(-1, keepdims=True)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    out = np.einsum("bkgts,bskh->btkgh", qdq(probs, -1), qdq(v, 1))
    return out.reshape(b, t, n, h)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("n", "k"), [(4, 4), (4, 2), (4, 1)])  # multi-head, GQA, multi-query
def test_forward_is_the_mx_definition(is_causal, n, k):
    q, kk, v, bias = inputs(n=n, k=k)
    mask = jax.random.bernoulli(jax.random.key(9), 0.8, (2, 1, 32, 32)).at[..., 0].set(True)
    got = jaxmx.dot_product_attention(q, kk, v, bias, mask, is_causal=is_causal)
    want = reference_attention(q, kk, v, bias, mask, is_causal)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("n", "k"), [(4, 4), (4, 2)])
def test_matches_jax_nn_to_mxfp8_accuracy_forward_and_gradients(is_causal, n, k):
    q, kk, v, bias = inputs(n=n, k=k, seed=1)
    ct = jax.random.normal(jax.random.key(5), q.shape)

    def loss(attention):
        return lambda q, k, v: (attention(q, k, v, bias, is_causal=is_causal) * ct).sum()

    mx = jax.value_and_grad(loss(jaxmx.dot_product_attention), argnums=(0, 1, 2))(q, kk, v)
    hp = jax.value_and_grad(loss(jax.nn.dot_product_attention), argnums=(0, 1, 2))(q, kk, v)
    out_mx = jaxmx.dot_product_attention(q, kk, v, bias, is_causal=is_causal)
    out_hp = jax.nn.dot_product_attention(q, kk, v, bias, is_causal=is_causal)
    assert 1e-3 < rel(out_mx, out_hp) < 0.08  # quantized, to MXFP8 accuracy
    for g_mx, g_hp in zip(mx[1], hp[1], strict=True):
        assert 1e-3 < rel(g_mx, g_hp) < 0.12


def test_unbatched_inputs_and_bfloat16():
    q, kk, v, _ = inputs(n=2, k=2)
    out = jaxmx.dot_product_attention(q[0].astype(jnp.bfloat16), kk[0], v[0])
    assert out.shape == q.shape[1:] and out.dtype == jnp.bfloat16
    full = jaxmx.dot_product_attention(q.astype(jnp.bfloat16), kk, v)[0]
    np.testing.assert_array_equal(out, full)


def test_bad_inputs():
    q, kk, v, _ = inputs(n=3, k=2)
    with pytest.raises(ValueError, match="N a multiple of K"):
        jaxmx.dot_product_attention(q, kk, v)
    q, kk, v, _ = inputs()
    with pytest.raises(ValueError, match="the same shape"):
        jaxmx.dot_product_attention(q, kk, v[:, :8])
    with pytest.raises(TypeError, match="mask must be boolean"):
        jaxmx.dot_product_attention(q, kk, v, mask=jnp.ones((32, 32)))
