"""jaxmx.KVCache at its boundary: page tables, positions and sizes checked statically, eagerly,
or (traced) with checked=True under checkify; unchecked traced writes outside the cache dropped
in both layouts; out-of-pool pages read as NaN."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxmx

B, L, D = 2, 8, 32


def _kv(n, seed=0):
    return jax.random.normal(jax.random.key(seed), (B, n, 1, D), jnp.float32)


def _paged(table):
    cache = jaxmx.KVCache.create(B, L, 1, D, page_size=4)
    return dataclasses.replace(cache, page_table=jnp.asarray(table, jnp.int32))


@pytest.mark.parametrize("entry", [99, -1])
def test_a_page_table_entry_outside_the_pool_raises_eagerly(entry):
    cache = _paged([[0, 1], [2, entry]])
    x = _kv(1)
    msg = rf"page_table\[1, 1\] = {entry} \(sequence 1, logical page 1\) is not a page of the pool"
    with pytest.raises(ValueError, match=msg + r" \[0, 4\) of the paged mxfp8_e4m3 cache"):
        cache.update(x, x, 0)
    with pytest.raises(ValueError, match=msg):
        jaxmx.cached_attention(jnp.zeros((B, 1, 1, D)), cache, length=1)
    with pytest.raises(ValueError, match=r"page_table of .* must be \[batch=2, pages_per_seq=2\]"):
        _paged([[0, 1, 2], [3, 0, 1]]).update(x, x, 0)


def test_traced_out_of_pool_pages_drop_writes_and_read_nan():
    x = _kv(8)
    step = jax.jit(lambda c, x: c.update(x, x, 0))
    cache = step(_paged([[0, 1], [2, -1]]), x)  # sequence 1's page 1 is nowhere
    clean = _paged([[0, 1], [2, 3]]).update(x, x, 0)
    got = np.asarray(cache.k_codes, np.float32)
    np.testing.assert_array_equal(got[:3], np.asarray(clean.k_codes, np.float32)[:3])
    assert not got[3].any()  # page 3 (another sequence's, were -1 to wrap) untouched
    keys = np.asarray(jaxmx.dequantize(jax.jit(lambda c: c.keys())(cache)))
    assert np.isnan(keys[1, :, 4:]).all() and np.isfinite(keys[:, :, :4]).all()
    out = jax.jit(lambda c, q, n: jaxmx.cached_attention(q, c, length=n))(
        cache, jnp.ones((B, 1, 1, D)), jnp.int32(4)
    )
    assert np.isfinite(np.asarray(out)).all()  # the bad page is masked at length 4


@pytest.mark.parametrize("page_size", [None, 4], ids=["contiguous", "paged"])
def test_traced_positions_outside_the_cache_are_dropped_alike(page_size):
    x = _kv(3)
    cache = jaxmx.KVCache.create(B, L, 1, D, page_size=page_size)
    step = jax.jit(lambda c, x, i: c.update(x, x, i))
    want = jaxmx.quantize(x, "mxfp8_e4m3", -1).data
    for index, kept in ((-1, ((1, 0), (2, 1))), (7, ((0, 7),))):  # (token, position)
        got = np.asarray(step(cache, x, jnp.int32(index)).keys().data, np.float32)
        written = np.zeros_like(got)
        for token, pos in kept:
            written[:, :, pos] = np.asarray(want[:, token], np.float32)
        np.testing.assert_array_equal(got, written)


@pytest.mark.parametrize("page_size", [None, 4], ids=["contiguous", "paged"])
def test_more_tokens_than_max_len_raise_under_jit(page_size):
    cache = jaxmx.KVCache.create(B, L, 1, D, page_size=page_size)
    x = _kv(L + 1)
    with pytest.raises(ValueError, match=r"9 new tokens do not fit in the max_len 8 of the"):
        jax.jit(lambda c, x, i: c.update(x, x, i))(cache, x, jnp.int32(0))


def test_checked_mode_raises_under_checkify():
    cache = _paged([[0, 1], [2, 3]])
    x = _kv(2)

    def step(cache, table, index, length):
        cache = dataclasses.replace(cache, page_table=table).update(x, x, index, checked=True)
        q = jnp.ones((B, 1, 1, D))
        return jaxmx.cached_attention(q, cache, length=length, checked=True)

    run = checkify.checkify(jax.jit(step))
    good = (cache.page_table, jnp.int32(2), jnp.array([4, 3], jnp.int32))
    err, out = run(cache, *good)
    assert err.get() is None and np.isfinite(np.asarray(out)).all()
    cases = [
        (jnp.array([[0, 1], [2, 9]], jnp.int32), *good[1:]),
        (good[0], jnp.array([1, 7], jnp.int32), good[2]),
        (*good[:2], jnp.array([4, -1], jnp.int32)),
    ]
    messages = [
        r"KVCache.update: page_table\[1, 1\] = 9 \(sequence 1, logical page 1\) is not a page",
        r"KVCache.update: index 7 of sequence 1 out of range \[0, 6\]",
        r"cached_attention: length -1 of sequence 1 out of range \[0, 8\]",
    ]
    for args, msg in zip(cases, messages, strict=True):
        err, _ = run(cache, *args)
        assert err.get() is not None
        with pytest.raises(Exception, match=msg):
            err.throw()
    with pytest.raises(ValueError, match="checkify"):  # checked, but not under checkify
        jax.jit(step)(cache, *good)


def test_unknown_format_lists_only_formats_the_cache_takes():
    with pytest.raises(ValueError, match="unknown fmt 'int8'") as e:
        jaxmx.KVCache.create(1, 8, 1, 32, fmt="int8")
    listed = str(e.value)
    assert "'mxfp8_e4m3'" in listed and "'fp8_e4m3_block'" in listed
    assert "_tensor" not in listed and "_row'" not in listed


def test_masked_pv_propagates_visible_infinities_as_float_does():
    """Against numpy float64: sum over the visible keys of p * v (0 * inf is NaN)."""
    from jaxmx._src.serving.masked_attention import masked_pv

    v = np.zeros((1, 1, 4, 3), np.float32)  # [b, k, s, d]
    v[0, 0, :, 0] = [1, np.inf, 2, 3]  # +inf at key 1
    v[0, 0, :, 1] = [np.inf, 1, -np.inf, np.nan]  # +inf and -inf, NaN at key 3
    v[0, 0, :, 2] = [1, 2, np.inf, 4]  # inf at key 2
    p = np.array([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.0, 0.5]], np.float32)  # [t, s]
    visible = np.array([[1, 1, 1, 0], [1, 1, 0, 1]], bool)  # query 0 sees key 2 with p 0
    got = np.asarray(masked_pv(jnp.asarray(p)[None, None, None], visible[None, None, None], v))
    with np.errstate(invalid="ignore"):
        terms = p[:, :, None] * v[0, 0][None].astype(np.float64)
        want = np.where(visible[:, :, None], terms, 0).sum(1)
    np.testing.assert_array_equal(got[0, :, 0, 0], want)
