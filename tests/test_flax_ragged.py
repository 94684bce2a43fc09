"""jaxmx.flax.MXRaggedDot: the grouped-GEMM hook a module of experts holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmx
from jaxmx import diagnostics
from jaxmx.flax import MXRaggedDot

SIZES = jnp.array([3, 0, 4])  # 7 of 8 rows in groups


def operands(integers=False):
    keys = jax.random.split(jax.random.key(0), 2)
    if integers:  # small integers: exact in MXFP8, so the MX GEMM is the exact product
        lhs = jax.random.randint(keys[0], (8, 32), -4, 5).astype(jnp.float32)
        return lhs, jax.random.randint(keys[1], (3, 32, 16), -4, 5).astype(jnp.float32)
    return jax.random.normal(keys[0], (8, 32)), jax.random.normal(keys[1], (3, 32, 16))


def test_equal_and_hashed_by_recipe_and_name():
    a, b = MXRaggedDot(), MXRaggedDot(jaxmx.recipes.MXFP8)
    assert a == b and hash(a) == hash(b)
    assert a != MXRaggedDot(None) and a != MXRaggedDot(jaxmx.recipes.NVFP4)
    assert a != MXRaggedDot(name="experts")
    with pytest.raises(AttributeError):
        a.recipe = None


def value_and_grads(f, lhs, rhs):
    out, pullback = jax.vjp(lambda a, b: f(a, b, SIZES), lhs, rhs)
    return (out, *pullback(jnp.ones_like(out)))


def test_recipe_none_is_lax_ragged_dot_bit_for_bit():
    lhs, rhs = operands()
    got = value_and_grads(MXRaggedDot(None), lhs, rhs)
    want = value_and_grads(jax.lax.ragged_dot, lhs, rhs)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    bf16 = MXRaggedDot(None)(lhs, rhs, SIZES, preferred_element_type=jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16


def test_mxfp8_is_jaxmx_ragged_dot_and_exact_on_small_integers():
    lhs, rhs = operands()
    got = value_and_grads(MXRaggedDot(), lhs, rhs)
    want = value_and_grads(lambda a, b, s: jaxmx.ragged_dot(a, b, s), lhs, rhs)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    lhs, rhs = operands(integers=True)
    want = np.zeros((8, 16))
    for j, (a, b) in enumerate([(0, 3), (3, 3), (3, 7)]):
        want[a:b] = np.asarray(lhs)[a:b] @ np.asarray(rhs)[j]
    np.testing.assert_array_equal(MXRaggedDot()(lhs, rhs, SIZES), want)


def test_name_is_the_telemetry_name():
    lhs, rhs = operands()
    with diagnostics.telemetry() as named:
        MXRaggedDot(name="moe/experts")(lhs, rhs, SIZES)
    with diagnostics.telemetry() as unnamed:
        MXRaggedDot()(lhs, rhs, SIZES)
    assert list(named.forward) == ["moe/experts"]
    assert list(unnamed.forward) == ["ragged_dot"]
