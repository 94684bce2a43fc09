"""jaxmx.KVCache and jaxmx.cached_attention against numpy references (tests/reference.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import jaxmx

B, KVH, D = 2, 2, 32


def _normal(seed, shape):
    return np.asarray(jax.random.normal(jax.random.key(seed), shape, jnp.float32))


def _quantized(x, fmt):
    """jaxmx.quantize of rows along head_dim (NVFP4 with the cache's fixed tensor scale 1)."""
    g = jnp.float32(1.0) if fmt == "nvfp4" else None
    return jaxmx.quantize(jnp.asarray(x), fmt, -1, global_scale=g)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(np.uint32)


def _fill(cache, k, v, writes):
    """The cache after writing k[:, i:i+n], v[:, i:i+n] for each (i, n) of ``writes``."""
    for i, n in writes:
        cache = cache.update(k[:, i : i + n], v[:, i : i + n], i)
    return cache


def _check_rows(cache, k, v, upto):
    """The cache's logical K / V (heads-major) equal jaxmx.quantize of the rows, bit for bit."""
    for got, x in ((cache.keys(), k), (cache.values(), v)):
        want = _quantized(x[:, :upto], cache.fmt)
        np.testing.assert_array_equal(
            _bits(got.data[:, :, :upto]), _bits(want.data.transpose(0, 2, 1, 3))
        )
        np.testing.assert_array_equal(
            _bits(got.scale[:, :, :upto]), _bits(want.scale.transpose(0, 2, 1, 3))
        )


WRITES = ((0, 5), (5, 1), (6, 1), (7, 3))  # a prefill, two decode steps, a 3-token chunk


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4"])
def test_codes_and_scales_are_quantize_of_the_rows(fmt):
    k, v = _normal(0, (B, 16, KVH, D)), _normal(1, (B, 16, KVH, D))
    cache = _fill(jaxmx.KVCache.create(B, 16, KVH, D, fmt=fmt), k, v, WRITES)
    _check_rows(cache, k, v, 10)
    if fmt in ref.SPECS:  # and the codes against the numpy reference quantizer
        data, scale = ref.quantize(k[:, :10], fmt, axis=-1)
        got = cache.keys()
        np.testing.assert_array_equal(_bits(got.data[:, :, :10]), _bits(data.transpose(0, 2, 1, 3)))
        np.testing.assert_array_equal(_bits(got.scale[:, :, :10]), scale.transpose(0, 2, 1, 3))


def test_paged_writes_cross_pages_through_a_permuted_page_table():
    k, v = _normal(2, (B, 16, KVH, D)), _normal(3, (B, 16, KVH, D))
    cache = jaxmx.KVCache.create(B, 16, KVH, D, page_size=4)
    assert cache.k_codes.shape == (8, KVH, 4, D) and cache.page_table.shape == (B, 4)
    table = jnp.array([[5, 2, 7, 0], [1, 6, 3, 4]], jnp.int32)
    cache = dataclasses.replace(cache, page_table=table)
    cache = _fill(cache, k, v, WRITES)  # (7, 3) crosses from page 1 into page 2
    _check_rows(cache, k, v, 10)
    # token 9 of sequence 1 is logical page 2, offset 1: physical page 3
    want = _quantized(k[1, 9], "mxfp8_e4m3")
    np.testing.assert_array_equal(_bits(cache.k_codes[3, :, 1]), _bits(want.data))


def test_per_batch_index():
    k, v = _normal(4, (B, 1, KVH, D)), _normal(5, (B, 1, KVH, D))
    for page_size in (None, 4):
        cache = jaxmx.KVCache.create(B, 8, KVH, D, page_size=page_size)
        cache = jax.jit(jaxmx.KVCache.update)(cache, k, v, jnp.array([2, 5], jnp.int32))
        got, want = cache.keys(), _quantized(k, "mxfp8_e4m3")
        for b, i in ((0, 2), (1, 5)):
            np.testing.assert_array_equal(_bits(got.data[b, :, i]), _bits(want.data[b, 0]))
        assert not np.asarray(got.data[0, :, 5], np.float32).any()


def _reference_attention(q, k, v, length, is_causal, fmt):
    """float64 attention of the MX-decoded q, K, V (numpy reference quantizer); [B, T, H, D]."""

    def mx(x):
        data, scale = ref.quantize(x, fmt, axis=-1)
        return ref.dequantize(data, scale, -1, x.shape)

    b, t, h, d = q.shape
    groups = h // k.shape[2]
    qd, kd, vd = mx(q), np.repeat(mx(k), groups, axis=2), np.repeat(mx(v), groups, axis=2)
    logits = np.einsum("bthd,bshd->bhts", qd, kd) / np.sqrt(d)
    length = np.broadcast_to(np.asarray(length), (b,))
    key = np.arange(k.shape[1])[None, None, None, :]
    visible = key < length[:, None, None, None]
    if is_causal:
        query = length[:, None, None, None] - t + np.arange(t)[None, None, :, None]
        visible = visible & (key <= query)
    logits = np.where(visible, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, vd)


CASES = {  # name: (heads, q_len, written, length, is_causal, page_size, fmt)
    "full": (2, 1, 16, 16, True, None, "mxfp8_e4m3"),
    "partly_filled": (2, 1, 10, 10, True, None, "mxfp8_e4m3"),
    "paged": (2, 1, 10, 10, True, 4, "mxfp8_e4m3"),
    "gqa_prefill": (4, 5, 5, 5, True, None, "mxfp8_e4m3"),
    "prefill_chunk_paged": (4, 3, 10, 10, True, 4, "mxfp8_e4m3"),
    "per_batch_lengths": (4, 2, 10, (7, 10), True, 4, "mxfp8_e4m3"),
    "not_causal": (2, 3, 10, 9, False, None, "mxfp8_e4m3"),
    "mxfp4": (4, 2, 10, 10, True, None, "mxfp4"),
}


@pytest.mark.parametrize("case", CASES)
def test_cached_attention_matches_a_float64_reference(case):
    heads, t, written, length, is_causal, page_size, fmt = CASES[case]
    k, v = _normal(6, (B, 16, KVH, D)), 4 * _normal(7, (B, 16, KVH, D))
    q = _normal(8, (B, t, heads, D))
    cache = jaxmx.KVCache.create(B, 16, KVH, D, fmt=fmt, page_size=page_size)
    cache = cache.update(k[:, :written], v[:, :written], 0)
    length_arg = jnp.array(length, jnp.int32) if isinstance(length, tuple) else length
    got = jaxmx.cached_attention(jnp.asarray(q), cache, length=length_arg, is_causal=is_causal)
    want = _reference_attention(q, k, v, length, is_causal, fmt)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_a_jitted_decode_loop_compiles_once():
    k, v = _normal(9, (B, 6, KVH, D)), _normal(10, (B, 6, KVH, D))
    q = _normal(11, (B, 6, 4, D))
    traces = []

    @jax.jit
    def step(cache, q, k, v, index):
        traces.append(1)
        cache = cache.update(k, v, index)
        return cache, jaxmx.cached_attention(q, cache, length=index + 1)

    cache = jaxmx.KVCache.create(B, 8, KVH, D, page_size=4)
    outs = []
    for i in range(6):
        s = slice(i, i + 1)
        cache, out = step(
            cache, jnp.asarray(q[:, s]), jnp.asarray(k[:, s]), jnp.asarray(v[:, s]), jnp.int32(i)
        )
        outs.append(np.asarray(out))
    assert len(traces) == 1
    for i in (0, 5):  # step i sees tokens 0..i
        want = _reference_attention(
            q[:, i : i + 1], k[:, : i + 1], v[:, : i + 1], i + 1, True, "mxfp8_e4m3"
        )
        np.testing.assert_allclose(outs[i], want, rtol=2e-5, atol=2e-5)


def test_an_mxfp8_cache_holds_about_half_of_bf16():
    batch, max_len, kv_heads, head_dim = 2, 64, 4, 128
    bf16 = batch * max_len * kv_heads * head_dim * 2 * 2  # K and V, 2 bytes each
    cache = jaxmx.KVCache.create(batch, max_len, kv_heads, head_dim)
    assert cache.nbytes == bf16 // 2 + 2 * batch * max_len * kv_heads * head_dim // 32
    assert cache.nbytes <= 0.52 * bf16
    fp4 = jaxmx.KVCache.create(batch, max_len, kv_heads, head_dim, fmt="mxfp4")
    assert fp4.nbytes <= 0.27 * bf16


def test_the_cache_is_a_pytree():
    cache = jaxmx.KVCache.create(B, 8, KVH, D, page_size=4)
    leaves, tree = jax.tree.flatten(cache)
    assert len(leaves) == 5
    again = jax.tree.unflatten(tree, leaves)
    assert again.page_size == 4 and again.max_len == 8 and again.fmt == "mxfp8_e4m3"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cache.max_len = 9


def test_bad_inputs_raise_clear_errors():
    create = jaxmx.KVCache.create
    with pytest.raises(ValueError, match="unknown fmt 'int8'"):
        create(1, 8, 1, 32, fmt="int8")
    for fmt, span in (("fp8_e4m3_tensor", "tensor"), ("fp8_e4m3_row", "row")):
        with pytest.raises(ValueError, match=f"{fmt}' has one scale per {span}"):
            create(1, 8, 1, 32, fmt=fmt)
    with pytest.raises(ValueError, match="head_dim 40 must be a multiple of mxfp8_e4m3's block"):
        create(1, 8, 1, 40)
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        create(1, 0, 1, 32)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        create(1, 8, 1, 32, page_size=0)
    cache = create(2, 8, 2, 32)
    x = jnp.zeros((2, 3, 2, 32))
    with pytest.raises(ValueError, match=r"k must be \[batch=2, new_len, kv_heads=2"):
        cache.update(jnp.zeros((2, 3, 1, 32)), x, 0)
    with pytest.raises(ValueError, match="differ"):
        cache.update(x, jnp.zeros((2, 2, 2, 32)), 0)
    with pytest.raises(ValueError, match=r"index 6 of sequence 0 out of range \[0, 5\]"):
        cache.update(x, x, 6)
    with pytest.raises(ValueError, match=r"index -1 of sequence 0 out of range"):
        cache.update(x, x, -1)
    with pytest.raises(ValueError, match="scalar or a \\[batch=2\\] vector"):
        cache.update(x, x, jnp.zeros((3,), jnp.int32))
    with pytest.raises(TypeError, match="index must be an int"):
        cache.update(x, x, 1.5)
    q = jnp.zeros((2, 1, 3, 32))
    with pytest.raises(ValueError, match="3 heads must be a multiple of the cache's 2 kv_heads"):
        jaxmx.cached_attention(q, cache, length=1)
    with pytest.raises(ValueError, match=r"q must be \[batch=2, q_len, heads, head_dim=32\]"):
        jaxmx.cached_attention(jnp.zeros((2, 1, 2, 64)), cache, length=1)
    with pytest.raises(ValueError, match=r"length 9 of sequence 0 out of range \[0, 8\]"):
        jaxmx.cached_attention(jnp.zeros((2, 1, 2, 32)), cache, length=9)
    with pytest.raises(TypeError, match=r"must be a jaxmx\.KVCache"):
        jaxmx.cached_attention(q, {"k": 1}, length=1)
