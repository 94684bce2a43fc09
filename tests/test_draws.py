"""Stochastic rounding's uniform draws: the documented recipe reproduced in numpy, and the
statistics rounding relies on (uniform, independent across positions and keys).

The reference below is written from the recipe in ``jaxmx/_src/quantize/draws.py``'s
docstring (uint32 arithmetic in numpy), not from the code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxmx
from jaxmx._src.quantize import draws


def _mix(x):
    x = np.asarray(x, np.uint32)  # uint32 arithmetic, wrapping (0-d arrays included)
    with np.errstate(over="ignore"):
        return _mix_wrapping(x)


def _mix_wrapping(x):
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _reference(words, shape, limit=2**32):
    seed = np.array([0x9E3779B9], np.uint32)
    for w in np.asarray(words, np.uint32).reshape(-1):
        seed = _mix(seed ^ w)
    groups, count = [], limit
    for axis in reversed(range(len(shape))):
        if count * shape[axis] >= limit:
            groups.insert(0, [])
            count = 1
        groups[0].insert(0, axis)
        count *= shape[axis]
    grids = np.indices(shape, dtype=np.uint64)
    h = np.full(shape, seed[0], np.uint32)
    for axes in groups:
        flat = np.zeros(shape, np.uint64)
        for axis in axes:
            flat = flat * np.uint64(shape[axis]) + grids[axis]
        h = _mix(h ^ flat.astype(np.uint32))
    h = _mix(h + seed[0])
    return (h >> np.uint32(8)).astype(np.float64) * 2.0**-24


@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 32, 4), (1,), ()])
def test_draws_follow_the_documented_recipe(shape):
    key = jax.random.key(7)
    got = np.asarray(draws.uniform_draws(key, shape), np.float64)
    np.testing.assert_array_equal(got, _reference(jax.random.key_data(key), shape))
    legacy = jax.random.PRNGKey(3)  # a raw uint32[2] key
    got = np.asarray(jax.jit(draws.uniform_draws, static_argnums=1)(legacy, shape), np.float64)
    np.testing.assert_array_equal(got, _reference(legacy, shape))


@pytest.mark.parametrize("first", [0.0, -0.0, -1.5, np.nan, -np.inf, 1e-45])
@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 32, 4), ()])
def test_draws_tied_to_the_rounded_array_are_the_same_draws(shape, first):
    key = jax.random.key(7)
    x = jnp.full((4, 2), first, jnp.bfloat16).at[1].set(3.0)
    got = np.asarray(jax.jit(draws.uniform_draws, static_argnums=1)(key, shape, tied_to=x))
    np.testing.assert_array_equal(got, _reference(jax.random.key_data(key), shape))


def test_draws_tied_to_the_rounded_array_stay_inside_a_scan():
    """A gradient rounded in each backward step of a ``lax.scan`` with draws from a fixed key:
    untied, the draws' full-size index depends on nothing in the loop and is moved out of it
    (4 bytes per element held across the loop); tied to the gradient it is computed where
    the gradient is rounded."""

    def temp(tied: bool) -> int:
        @jax.custom_vjp
        def rounded_gradient(h, key):
            return h

        def forward(h, key):
            return h, key

        def backward(key, g):
            u = draws.uniform_draws(key, g.shape, tied_to=g if tied else None)
            return jnp.floor(g * 8 + u) / 8, None

        rounded_gradient.defvjp(forward, backward)

        def loss(h, key):
            def step(h, _):
                return jnp.sin(rounded_gradient(h, key)), None

            return jnp.sum(jax.lax.scan(step, h, None, length=3)[0])

        h = jax.ShapeDtypeStruct((512, 512), jnp.float32)
        lowered = jax.jit(jax.grad(loss)).lower(h, jax.random.key(0))
        return lowered.compile().memory_analysis().temp_size_in_bytes

    assert temp(tied=True) < temp(tied=False) - 3 * 512 * 512  # the index: 1 MiB


def test_axes_are_grouped_below_the_index_limit(monkeypatch):
    """Past 2^32 elements the flat index would wrap: the axes are split into groups, each
    mixed in turn (checked with a small limit, the same rule)."""
    monkeypatch.setattr(draws, "_INDEX_LIMIT", 2**6)
    shape = (3, 5, 16, 8)  # groups (0, 1), (2,), (3,) under a limit of 64
    key = jax.random.key(1)
    got = np.asarray(draws.uniform_draws(key, shape), np.float64)
    np.testing.assert_array_equal(got, _reference(jax.random.key_data(key), shape, limit=2**6))
    assert len(np.unique(got)) == got.size
    tied = draws.uniform_draws(key, shape, tied_to=jnp.ones(3))
    np.testing.assert_array_equal(np.asarray(tied, np.float64), got)


def test_draws_are_uniform_on_24_bits():
    u = np.asarray(draws.uniform_draws(jax.random.key(0), (64, 1024)), np.float64)
    assert (u >= 0).all() and (u < 1).all()
    units = u * 2**24
    np.testing.assert_array_equal(units, np.round(units))  # multiples of 2^-24
    assert len(np.unique(units.astype(np.int64) % 256)) == 256  # the low bits vary too
    counts = np.histogram(u, bins=64, range=(0, 1))[0]
    chi2 = ((counts - u.size / 64) ** 2 / (u.size / 64)).sum()
    assert chi2 < stats.chi2.isf(1e-6, 63), chi2


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_neighbouring_draws_are_uncorrelated(axis):
    u = np.asarray(draws.uniform_draws(jax.random.key(2), (16, 64, 64)), np.float64) - 0.5
    a, b = np.moveaxis(u, axis, 0)[:-1], np.moveaxis(u, axis, 0)[1:]
    corr = (a * b).mean() / (u**2).mean()
    assert abs(corr) < 5 / np.sqrt(a.size), corr  # 5 sigma of a zero correlation


def test_keys_give_uncorrelated_draws():
    k0, k1 = jax.random.split(jax.random.key(0))
    shape = (128, 256)
    draws_of = [np.asarray(draws.uniform_draws(k, shape), np.float64) - 0.5 for k in (k0, k1)]
    draws_of.append(np.asarray(draws.uniform_draws(jax.random.key(1), shape)) - 0.5)
    for i in range(3):
        for j in range(i):
            corr = (draws_of[i] * draws_of[j]).mean() / 12**-1
            assert abs(corr) < 5 / np.sqrt(draws_of[i].size), (i, j, corr)
    # a typed key and its raw data give the same draws
    np.testing.assert_array_equal(
        np.asarray(draws.uniform_draws(k0, shape)),
        np.asarray(draws.uniform_draws(jax.random.key_data(k0), shape)),
    )


def test_quantize_rounds_with_these_draws():
    """Stochastic rounding goes up exactly where the draw is below the fraction: values half
    way between two E4M3 neighbours (1 and 1.125) go up where the draw is below 1/2."""
    x = np.full((4, 64), 1.0625, np.float32)
    key = jax.random.key(5)
    q = jaxmx.quantize(x, "mxfp8_e4m3", key=key)
    up = np.asarray(jaxmx.dequantize(q)) == 1.125
    # quantize draws in the blocked layout [outer, blocks, block, inner]: here [4, 2, 32, 1]
    u = _reference(jax.random.key_data(key), (4, 2, 32, 1)).reshape(4, 64)
    np.testing.assert_array_equal(up, u < 0.5)


def test_an_axis_past_the_index_limit_is_refused():
    with pytest.raises(ValueError, match="2\\^32"):
        jax.eval_shape(lambda: draws.uniform_draws(jax.random.key(0), (2**32,)))
