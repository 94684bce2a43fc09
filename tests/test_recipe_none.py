"""``recipe=None`` means plain high precision everywhere jaxmx takes a recipe: the stock JAX op,
bit for bit, values and gradients (the Flax layers already meant that)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmx

TN = (((1,), (1,)), ((), ()))


def operands(*shapes):
    keys = jax.random.split(jax.random.key(0), len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]


def assert_same(f, g, *args):
    np.testing.assert_array_equal(f(*args), g(*args))
    grads = [jax.grad(lambda *a, h=h: (h(*a) ** 2).sum(), range(len(args)))(*args) for h in (f, g)]
    jax.tree.map(np.testing.assert_array_equal, *grads)


def test_dot_general_without_a_recipe_is_lax_dot_general():
    x, w = operands((8, 64), (16, 64))
    hp = jax.lax.Precision.HIGHEST
    assert_same(
        lambda x, w: jaxmx.dot_general(x, w, TN, hp, recipe=None),
        lambda x, w: jax.lax.dot_general(x, w, TN, hp),
        x,
        w,
    )


def test_einsum_and_attention_without_a_recipe_are_high_precision():
    a, b = operands((2, 8, 32), (2, 32, 16))
    hp = jax.lax.Precision.HIGHEST
    with jax.default_matmul_precision("highest"):
        assert_same(
            lambda a, b: jaxmx.einsum("bmk,bkn->bmn", a, b, recipe=None),
            lambda a, b: jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))), hp),
            a,
            b,
        )
        q, k, v = operands((1, 8, 2, 32), (1, 8, 2, 32), (1, 8, 2, 32))
        got = jaxmx.dot_product_attention(q, k, v, recipe=None)
        want = jax.nn.dot_product_attention(q, k, v)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_ragged_dot_without_a_recipe_is_lax_ragged_dot():
    lhs, rhs = operands((12, 64), (3, 64, 16))
    sizes = jnp.array([5, 0, 7], jnp.int32)
    assert_same(
        lambda a, b: jaxmx.ragged_dot(a, b, sizes, recipe=None),
        lambda a, b: jax.lax.ragged_dot(a, b, sizes),
        lhs,
        rhs,
    )


def test_a_wrong_recipe_still_names_the_choices():
    x, w = operands((8, 64), (16, 64))
    with pytest.raises(TypeError, match=r"recipe must be a jaxmx.Recipe .* or None"):
        jaxmx.dot_general(x, w, TN, recipe="mxfp8")
