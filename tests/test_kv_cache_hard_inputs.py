"""jaxmx.cached_attention over NaN / inf in q, K and V, inside and outside the valid length and
under causal masks, for every cache format and both layouts, eager and jit, against a float64
numpy attention of the decoded operands that masks explicitly: masked keys contribute nothing,
visible non-finite values propagate."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmx

FORMATS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4", "fp8_e4m3_block", "fp8_e5m2_block"]
MAX_LEN, LENGTH, WRITTEN, T, KVH, H = 8, 5, 7, 3, 1, 2  # queries at positions 2, 3, 4


def _head_dim(fmt):
    return max(32, jaxmx.FORMATS[fmt].block)


def _decoded(x, fmt):
    """x [..., d] as the cache stores it (quantized along d; NVFP4 with tensor scale 1)."""
    g = jnp.float32(1.0) if fmt == "nvfp4" else None
    q = jaxmx.quantize(jnp.asarray(x), fmt, -1, global_scale=g)
    return np.asarray(jaxmx.dequantize(q, jnp.float32), np.float64)


def _reference(q, k, v, length, is_causal):
    """float64 attention [b, t, h, d] summing over the visible keys only (0 if none)."""
    b, t, h, d = q.shape
    k, v = np.repeat(k, h // k.shape[2], axis=2), np.repeat(v, h // v.shape[2], axis=2)
    key = np.arange(k.shape[1])[None, None, None, :]
    visible = key < np.asarray(length)[:, None, None, None]
    if is_causal:
        query = np.asarray(length)[:, None, None, None] - t + np.arange(t)[None, None, :, None]
        visible = visible & (key <= query)
    visible = np.broadcast_to(visible, (b, h, t, k.shape[1]))
    with np.errstate(invalid="ignore", over="ignore"):
        logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d)
        logits = np.where(visible, logits, -np.inf)
        top = logits.max(-1, keepdims=True)
        e = np.where(visible, np.exp(logits - np.where(visible.any(-1, keepdims=True), top, 0)), 0)
        p = e / np.where(visible.any(-1, keepdims=True), e.sum(-1, keepdims=True), 1)
        terms = p[..., None] * v.transpose(0, 2, 1, 3)[:, :, None]  # [b, h, t, s, d]
        out = np.where(visible[..., None], terms, 0).sum(-2)
    return out.transpose(0, 2, 1, 3)


# one poison per sequence: (tensor, position, query, value); query t sits at position 2 + t
POISONS = [
    (),  # clean
    (("k", 1, None, np.nan),),  # visible to every query
    (("k", 4, None, np.inf),),  # visible to the last query only (causal)
    (("v", 6, None, np.nan), ("k", 6, None, np.inf)),  # past the length: no effect
    (("v", 3, None, -np.inf),),  # visible to queries 1 and 2
    (("v", 4, None, np.nan), ("q", None, 0, np.nan)),  # query 0's NaN; V at 4 for query 2
    (("v", 3, None, np.inf), ("v", 2, None, -np.inf)),  # seen by every query
]


def _inputs(d):
    b = len(POISONS)
    rng = np.random.default_rng(0)
    q, k, v = (
        rng.standard_normal(s).astype(np.float32)
        for s in ((b, T, H, d),) + 2 * ((b, MAX_LEN, KVH, d),)
    )
    x = {"q": q, "k": k, "v": v}
    for s, poisons in enumerate(POISONS):
        for name, pos, query, value in poisons:
            if name == "q":
                x["q"][s, query, 0, 1] = value
            else:
                x[name][s, pos, 0, 3] = value
    return x


def _garbage(cache):
    """The cache with every scale and code byte 0xFF (NaN where the dtype has it; packed E2M1
    codes, which have no NaN, -6): a reused page's leftovers."""

    def nan(a):
        width = {1: jnp.uint8, 4: jnp.uint32}[a.dtype.itemsize]
        return jax.lax.bitcast_convert_type(jnp.full(a.shape, jnp.iinfo(width).max, width), a.dtype)

    fields = ("k_codes", "k_scales", "v_codes", "v_scales")
    return dataclasses.replace(cache, **{f: nan(getattr(cache, f)) for f in fields})


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("page_size", [None, 4], ids=["contiguous", "paged"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_inputs_match_masked_float_attention(fmt, page_size, jit):
    d = _head_dim(fmt)
    x = _inputs(d)
    b = len(POISONS)
    cache = _garbage(jaxmx.KVCache.create(b, MAX_LEN, KVH, d, fmt=fmt, page_size=page_size))
    length = jnp.full((b,), LENGTH, jnp.int32)

    def run(cache, q, k, v, length):
        cache = cache.update(k, v, 0)
        return jaxmx.cached_attention(q, cache, length=length)

    run = jax.jit(run) if jit else run
    got = np.asarray(run(cache, x["q"], x["k"][:, :WRITTEN], x["v"][:, :WRITTEN], length))
    want = _reference(
        _decoded(x["q"], fmt), _decoded(x["k"], fmt), _decoded(x["v"], fmt), length, True
    )
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)  # NaN and inf where want has them
    # the cases, spelled out: clean rows finite, poisoned ones NaN where they are seen (an inf
    # has no code: its block decodes to NaN)
    blk = jaxmx.FORMATS[fmt].block
    assert np.isfinite(got[0]).all() and np.isfinite(got[3]).all()
    assert np.isnan(got[1]).all()
    assert np.isfinite(got[2, :2]).all() and np.isnan(got[2, 2]).all()
    assert np.isfinite(got[4, 0]).all() and np.isnan(got[4, 1:, :, :blk]).all()
    assert np.isfinite(got[4, 1:, :, blk:]).all()
    assert np.isnan(got[5, 0, 0]).all() and np.isfinite(got[5, :2, 1]).all()
    assert np.isfinite(got[5, 1]).all() and np.isnan(got[5, 2, :, :blk]).all()
    assert np.isnan(got[6, :, :, :blk]).all() and np.isfinite(got[6, :, :, blk:]).all()


@pytest.mark.parametrize("page_size", [None, 4], ids=["contiguous", "paged"])
def test_no_visible_key_is_zeros_and_not_causal_sees_all(page_size):
    d = 32
    x = _inputs(d)
    b = len(POISONS)
    cache = _garbage(jaxmx.KVCache.create(b, MAX_LEN, KVH, d, page_size=page_size))
    cache = cache.update(x["k"][:, :WRITTEN], x["v"][:, :WRITTEN], 0)
    length = np.array([0, 5, 5, 5, 0, 5, 5], np.int32)
    got = np.asarray(
        jaxmx.cached_attention(x["q"], cache, length=jnp.asarray(length), is_causal=False)
    )
    dec = {n: _decoded(a, "mxfp8_e4m3") for n, a in x.items()}
    want = _reference(dec["q"], dec["k"], dec["v"], length, False)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert not got[0].any() and not got[4].any()


@pytest.mark.parametrize("fmt", ["fp8_e4m3_block", "fp8_e5m2_block"])
def test_block_fp8_is_float32_close_to_its_decoded_operands(fmt):
    """Block FP8 decodes as code x float32 scale, rounded once to float32 (2^-24): the output is
    within float32 arithmetic of float64 attention over the decoded cache (numpy decodes the
    stored codes and scales itself). V through bfloat16 was 2^-9 off (about 2e-3)."""
    b, n, d = 2, 48, 128
    rng = np.random.default_rng(1)
    q, k, v = (
        rng.standard_normal(s).astype(np.float32) for s in ((b, 2, 2, d), *2 * [(b, n, 1, d)])
    )
    cache = jaxmx.KVCache.create(b, 64, 1, d, fmt=fmt, page_size=16).update(k, 3 * v, 0)
    length = np.array([48, 30])
    got = np.asarray(jaxmx.cached_attention(q, cache, length=jnp.asarray(length)))

    def decoded(mx):  # [b, kv_heads, max_len, d]: codes times their block's scale, in float64
        codes, scales = np.asarray(mx.data, np.float64), np.asarray(mx.scale, np.float64)
        return (codes * np.repeat(scales, d // scales.shape[-1], axis=-1)).transpose(0, 2, 1, 3)

    want = _reference(
        _decoded(q, fmt), decoded(cache.keys()), decoded(cache.values()), length, True
    )
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
