"""Inputs that used to be accepted silently or failed with a raw error (issue 23) raise errors
that name the argument; empty inputs quantize like MXFP8's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmx

DN = (((1,), (1,)), ((), ()))


@pytest.mark.parametrize("g", [-1.0, 0.0, float("nan"), float("inf")])
def test_nvfp4_global_scale_must_be_positive_and_finite(g):
    with pytest.raises(ValueError, match="global_scale must be positive and finite"):
        jaxmx.quantize(jnp.ones((4, 64)), "nvfp4", global_scale=g)


def test_nvfp4_empty_tensor_quantizes_like_an_all_zero_one():
    q = jaxmx.quantize(jnp.zeros((0, 64)), "nvfp4")
    zero = jaxmx.quantize(jnp.zeros((4, 64)), "nvfp4")
    assert q.data.shape == (0, 64) and q.scale.shape == (0, 4)
    assert q.global_scale == zero.global_scale
    assert jaxmx.dequantize(q).shape == (0, 64)


@pytest.mark.parametrize("shape", [(0, 64), (64, 0), (3, 0, 64)])
def test_tiled_quantize_of_an_empty_axis(shape):
    q = jaxmx.quantize(jnp.zeros(shape), tile=(32, 32))
    assert jaxmx.dequantize(q).shape == shape


def test_recipe_rejects_a_bool_accumulator_and_a_bare_weight_tile():
    with pytest.raises(TypeError, match="accum_bits"):
        jaxmx.Recipe(accum_bits=True)
    with pytest.raises(ValueError, match=r"Recipe\.weight_tile"):
        jaxmx.Recipe(weight_tile=32)


def test_ragged_dot_rejects_negative_concrete_group_sizes():
    with pytest.raises(ValueError, match="group_sizes must be non-negative"):
        jaxmx.ragged_dot(jnp.ones((6, 64)), jnp.ones((2, 64, 8)), jnp.array([-2, 4]))


def test_dot_general_checks_its_key_up_front():
    recipe = jaxmx.Recipe(grad_rounding="stochastic")
    with pytest.raises(TypeError, match=r"jaxmx\.dot_general: key must be a PRNG key"):
        jaxmx.dot_general(jnp.ones((8, 64)), jnp.ones((16, 64)), DN, recipe=recipe, key=jnp.ones(3))


def test_none_arguments_are_named():
    with pytest.raises(TypeError, match="quantize: x must be an array"):
        jaxmx.quantize(None)
    with pytest.raises(TypeError, match=r"jaxmx\.einsum: subscripts must be a string"):
        jaxmx.einsum(None, jnp.ones((4, 32)), jnp.ones((4, 32)))


@pytest.mark.parametrize("k", [-32, 0])
def test_gemm_probe_rejects_a_non_positive_size(k):
    with pytest.raises(ValueError, match="gemm_probe: k must be a positive integer"):
        jaxmx.diagnostics.gemm_probe(4, 4, k, key=jax.random.key(0))


def test_traced_values_are_left_unchecked():
    g = jax.jit(lambda g: jaxmx.quantize(jnp.ones((4, 64)), "nvfp4", global_scale=g).global_scale)
    assert np.asarray(g(-1.0)) == np.float32(2.0**-126)
    sizes = jnp.array([2, 4])
    y = jax.jit(lambda s: jaxmx.ragged_dot(jnp.ones((6, 64)), jnp.ones((2, 64, 8)), s))(sizes)
    assert y.shape == (6, 8)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: jaxmx.quantize_rowwise_colwise(None), "quantize_rowwise_colwise: x must be"),
        (lambda: jaxmx.swizzle_scales(None), "swizzle_scales: scales must be an array"),
        (lambda: jaxmx.unswizzle_scales(None, 4, 4), "unswizzle_scales: buf must be an array"),
        (
            lambda: jaxmx.ragged_dot(jnp.ones((4, 64)), jnp.ones((2, 64, 8)), None),
            r"jaxmx\.ragged_dot: group_sizes must be an array",
        ),
    ],
)
def test_none_arrays_of_the_other_entry_points_are_named(call, message):
    with pytest.raises(TypeError, match=message):
        call()
