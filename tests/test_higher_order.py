"""Differentiating the backward pass of jaxmx.dot_general or jaxmx.ragged_dot raises (its
quantization to integer codes would make such derivatives zero); first-order uses are
unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmx

DN = (((1,), (1,)), ((), ()))
SECOND_ORDER = "second-order derivatives"
RECIPES = [jaxmx.recipes.MXFP8, jaxmx.recipes.MXFP8.replace(residuals="high_precision")]


def operands():
    """x [8, 64], w [16, 64] and a cotangent-like c [8, 16]."""
    keys = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(keys[0], (8, 64)),
        jax.random.normal(keys[1], (16, 64)),
        jax.random.normal(keys[2], (8, 16)),
    )


def squared(w, recipe):
    """``x -> sum((x @ w.T) ** 2)`` through jaxmx.dot_general."""
    return lambda x: (jaxmx.dot_general(x, w, DN, recipe=recipe) ** 2).sum()


@pytest.mark.parametrize("recipe", RECIPES)
def test_grad_of_a_gradient_wrt_the_weight_raises(recipe):
    x, w, c = operands()

    def dx_norm(w):
        dx = jax.grad(lambda x: (jaxmx.dot_general(x, w, DN, recipe=recipe) * c).sum())(x)
        return (dx**2).sum()

    with pytest.raises(NotImplementedError, match=rf"jaxmx\.dot_general: {SECOND_ORDER}"):
        jax.grad(dx_norm)(w)


@pytest.mark.parametrize("recipe", RECIPES)
def test_hessian_raises(recipe):
    x, w, _ = operands()
    with pytest.raises(NotImplementedError, match=r"lax\.dot_general"):
        jax.hessian(squared(w, recipe))(x[:2])


@pytest.mark.parametrize("recipe", RECIPES)
def test_jvp_of_grad_raises(recipe):
    x, w, _ = operands()
    with pytest.raises(NotImplementedError, match=SECOND_ORDER):
        jax.jvp(jax.grad(squared(w, recipe)), (x,), (x,))


def test_forward_mode_of_dot_general_itself_is_refused_by_jax():
    x, w, _ = operands()
    with pytest.raises(TypeError, match="forward-mode autodiff"):
        jax.jvp(lambda x: jaxmx.dot_general(x, w, DN), (x,), (x,))


def test_forward_mode_of_ragged_dot_is_refused_like_dot_general():
    """Failed before: jax.jacfwd raised lax.ragged_dot's 'vmap over any dim but 0 - NYI' from
    inside the forward GEMM instead of JAX's refusal of forward mode for custom-VJP functions."""
    lhs, rhs, sizes = jnp.ones((6, 32)), jnp.ones((2, 32, 4)), jnp.array([2, 4])
    for argnums in (0, 1):
        with pytest.raises(TypeError, match="forward-mode autodiff"):
            jax.jacfwd(lambda a, b: jaxmx.ragged_dot(a, b, sizes), argnums)(lhs, rhs)
    with pytest.raises(TypeError, match="forward-mode autodiff"):
        jax.jvp(lambda a: jaxmx.ragged_dot(a, rhs, sizes), (lhs,), (lhs,))
    with pytest.raises(TypeError, match="forward-mode autodiff"):
        jax.jacfwd(lambda x: jaxmx.dot_general(x, rhs[0], (((1,), (0,)), ((), ()))))(lhs)


def test_ragged_dot_second_order_raises():
    lhs, sizes = jnp.ones((6, 64)), jnp.array([2, 4])
    rhs = jax.random.normal(jax.random.key(1), (2, 64, 8))

    def loss(lhs):
        return (jaxmx.ragged_dot(lhs, rhs, sizes) ** 2).sum()

    with pytest.raises(NotImplementedError, match=rf"jaxmx\.ragged_dot: {SECOND_ORDER}"):
        jax.jvp(jax.grad(loss), (lhs,), (lhs,))
    with pytest.raises(NotImplementedError, match=SECOND_ORDER):
        jax.grad(
            lambda r: (jax.grad(lambda a: jaxmx.ragged_dot(a, r, sizes).sum())(lhs) ** 2).sum()
        )(rhs)


@pytest.mark.parametrize("recipe", RECIPES)
def test_first_order_gradients_agree_under_jit_vmap_and_remat(recipe):
    x, w, _ = operands()

    def loss(x, w):
        return (jaxmx.dot_general(x, w, DN, recipe=recipe) ** 2).sum()

    eager = jax.grad(loss, argnums=(0, 1))(x, w)
    policy = jax.checkpoint_policies.save_only_these_names(jaxmx.LHS_COLWISE, jaxmx.RHS_COLWISE)
    variants = [
        jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w),
        jax.grad(jax.checkpoint(loss), argnums=(0, 1))(x, w),
        jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1))(x, w),
    ]
    per_row = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None))(x[:, None], w)
    for got in variants:
        for a, b in zip(got, eager, strict=True):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(per_row[0][:, 0], eager[0])


def test_grad_of_a_scalar_function_of_first_order_outputs():
    x, w, c = operands()
    value, dw = jax.value_and_grad(lambda w: jnp.tanh(jaxmx.dot_general(x, w, DN) * c).sum())(w)
    assert np.isfinite(value) and np.abs(np.asarray(dw)).max() > 0
