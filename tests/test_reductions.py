"""``max_along``: the maximum over long axes in steps of 32, equal to numpy's, and compiled
without a full-size copy of what it reduces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxmx._src.core.reductions import in_one_step, max_along


@pytest.mark.parametrize("axis", [0, 1, 2, -1, (0, 2), (0, 1, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_equals_numpy(axis, keepdims):
    x = np.random.default_rng(0).integers(-(10**6), 10**6, (3, 70, 33)).astype(np.int32)
    got = np.asarray(max_along(jnp.asarray(x), axis, keepdims=keepdims, neutral=-(2**31)))
    np.testing.assert_array_equal(got, x.max(axis=axis, keepdims=keepdims))


def test_nan_propagates_and_an_empty_axis_gives_the_neutral():
    x = np.zeros((2, 100), np.float32)
    x[1, 77] = np.nan
    assert np.isnan(np.asarray(max_along(jnp.asarray(x), 1))).tolist() == [False, True]
    assert max_along(jnp.zeros((2, 0)), 1, neutral=-1.0).tolist() == [-1.0, -1.0]


def _temp_bytes(fn, x) -> int:
    return jax.jit(fn).lower(x).compile().memory_analysis().temp_size_in_bytes


def test_the_reduced_operand_is_not_held():
    """The magnitude bits of a [256, 1024] tensor reduced per row and whole: a plain jnp.max
    holds them (XLA:CPU's reduce-window rewrite, 1 MiB); max_along holds at most a 32nd."""
    x = jnp.ones((256, 1024), jnp.float32)

    def magnitudes(x):
        return lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF

    plain = _temp_bytes(lambda x: jnp.max(magnitudes(x), axis=1), x)
    assert plain >= x.nbytes  # what the helper is for: if this fails, XLA no longer needs it
    for axis in (1, 0, (0, 1)):
        assert _temp_bytes(lambda x, axis=axis: max_along(magnitudes(x), axis), x) <= x.nbytes / 32


def test_in_one_step_reduces_in_one_operation():
    """For Pallas kernels (Triton lowers no optimization_barrier)."""
    x = jnp.ones((4, 1024), jnp.int32)
    with in_one_step():
        text = jax.jit(lambda x: max_along(x, 1)).lower(x).as_text()
    assert "optimization_barrier" not in text
    assert "optimization_barrier" in jax.jit(lambda x: max_along(x, 1)).lower(x).as_text()
