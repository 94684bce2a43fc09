"""NVFP4 quantization (E2M1, 16-blocks, E4M3 scales, float32 tensor scale) against numpy.

The reference (``tests/reference.py``'s ``nvfp4``) evaluates the formulas of the format's
definition in numpy float32 (which keeps subnormals) with ml_dtypes' round-to-nearest-even
casts; it shares no code with jaxmx.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import nvfp4 as reference_nvfp4

import jaxmx
from jaxmx._src.core.mxarray_layouts import swap_last_axes, untiled

F32 = np.float32


def adversarial(rng, shape):
    """Normal values with outliers, exact ties of the E2M1 grid, zeros, subnormals, huge."""
    x = rng.standard_normal(shape).astype(np.float32) * F32(2.0) ** rng.integers(-8, 8, shape)
    flat = x.reshape(-1)
    n = flat.size
    picks = rng.permutation(n)
    flat[picks[: n // 10]] = 0.0
    flat[picks[n // 10 : n // 5]] *= F32(2.0**-140)  # subnormal
    flat[picks[n // 5 : n // 5 + 3]] = F32(3e38)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    signs = rng.choice([-1, 1], n // 10)
    flat[picks[n // 4 : n // 4 + n // 10]] = rng.choice(ties, n // 10) * signs
    return x


def assert_matches(q, x, **kw):
    codes, scales, g, values = reference_nvfp4(x, **kw)
    got_g = np.asarray(q.global_scale).view(np.uint32)
    np.testing.assert_array_equal(got_g, np.array(g).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(q.scale).view(np.uint8), scales.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), codes.view(np.uint8))
    got = np.asarray(jaxmx.dequantize(q))
    slices = tuple(slice(0, n) for n in x.shape)
    np.testing.assert_array_equal(got.view(np.uint32), values[slices].view(np.uint32))


@pytest.mark.parametrize(
    "shape, axis",
    [((4, 64), -1), ((4, 64), 0), ((3, 40, 24), 1), ((37,), 0), ((2, 5, 48), -1)],
)
def test_quantize_matches_reference(shape, axis):
    x = adversarial(np.random.default_rng(sum(shape)), shape)
    assert_matches(jaxmx.quantize(x, "nvfp4", axis=axis), x, axis=axis)


@pytest.mark.parametrize("shape", [(32, 48), (40, 24), (2, 17, 33)])
def test_tiles_match_reference(shape):
    x = adversarial(np.random.default_rng(7), shape)
    assert_matches(jaxmx.quantize(x, "nvfp4", tile=(16, 16)), x, tile=(16, 16))


@pytest.mark.parametrize("scale_exponent", [-150, -140, -135, -128, -126, -120, -100, 0, 100, 120])
def test_tiny_and_huge_tensors(scale_exponent):
    """Tensors whose tensor scale is tiny (subnormal intermediates, r overflowing) or huge."""
    rng = np.random.default_rng(scale_exponent + 200)
    x = (rng.standard_normal((4, 64)) * 2.0 ** rng.integers(-6, 6, (4, 64))).astype(np.float32)
    x = (x.astype(np.float64) * 2.0**scale_exponent).astype(np.float32)
    assert_matches(jaxmx.quantize(x, "nvfp4"), x)


def test_special_values():
    x = np.zeros((3, 32), np.float32)
    x[0, 3] = np.nan  # tensor scale NaN: everything decodes to NaN
    assert_matches(jaxmx.quantize(x, "nvfp4"), x)
    assert np.isnan(np.asarray(jaxmx.dequantize(jaxmx.quantize(x, "nvfp4")))).all()
    y = np.ones((2, 32), np.float32)
    y[1, 20] = np.inf  # with a given tensor scale only the inf's block is NaN
    q = jaxmx.quantize(y, "nvfp4", global_scale=1.0 / 2688)
    assert_matches(q, y, global_scale=1.0 / 2688)
    nan_blocks = np.isnan(np.asarray(jaxmx.dequantize(q))).reshape(2, 2, 16).all(axis=-1)
    assert nan_blocks.tolist() == [[False, False], [False, True]]
    zero = jaxmx.quantize(np.zeros(20, np.float32), "nvfp4")
    assert float(zero.global_scale) == 2.0**-126  # not a division by zero
    assert not np.asarray(jaxmx.dequantize(zero)).any()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs(dtype):
    x = jnp.asarray(adversarial(np.random.default_rng(3), (8, 32)), dtype)
    assert_matches(jaxmx.quantize(x, "nvfp4"), np.asarray(x.astype(jnp.float32)))


def test_global_scale_given_and_jit():
    x = adversarial(np.random.default_rng(11), (4, 48))
    q = jax.jit(lambda x: jaxmx.quantize(x, "nvfp4", global_scale=0.25))(x)
    assert_matches(q, x, global_scale=0.25)


def test_stochastic_rounding_is_unbiased():
    # the block maximum maps to 6 exactly (E4M3 448 = 1.75 * 2^8), so no element saturates
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, (8, 16)).astype(np.float32)
    x[:, 0] = 1.0
    keys = jax.random.split(jax.random.key(0), 512)
    values = jax.vmap(lambda k: jaxmx.dequantize(jaxmx.quantize(x, "nvfp4", key=k)))(keys)
    values = np.asarray(values)
    q_nearest = np.asarray(jaxmx.dequantize(jaxmx.quantize(x, "nvfp4")))
    mean_error = values.mean(axis=0) - x
    standard_error = values.std(axis=0) / np.sqrt(len(keys)) + 1e-6
    assert np.abs(mean_error / standard_error).max() < 5
    assert (values != q_nearest).any()  # not round to nearest
    grid = np.abs(values) / float(jaxmx.quantize(x, "nvfp4").global_scale) / 448
    on_grid = np.isin(grid.round(6), [0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert on_grid.all()


def test_transposed_and_untiled_views_keep_the_global_scale():
    x = adversarial(np.random.default_rng(12), (32, 48))
    q = jaxmx.quantize(x, "nvfp4", tile=(16, 16))
    assert [leaf.dtype for leaf in jax.tree.leaves(q)][2] == jnp.float32
    values = np.asarray(jaxmx.dequantize(q))
    np.testing.assert_array_equal(np.asarray(jaxmx.dequantize(swap_last_axes(q))), values.T)
    np.testing.assert_array_equal(np.asarray(jaxmx.dequantize(untiled(q))), values)


def test_errors():
    with pytest.raises(ValueError, match="global_scale is NVFP4's"):
        jaxmx.quantize(jnp.ones(32), "mxfp4", global_scale=1.0)
    with pytest.raises(TypeError, match="global_scale must be a float scalar"):
        jaxmx.quantize(jnp.ones(32), "nvfp4", global_scale=jnp.ones(2))
    with pytest.raises(ValueError, match="unknown scale_mode"):
        jaxmx.quantize(jnp.ones(32), "nvfp4", scale_mode="rceil")
    q = jaxmx.quantize(jnp.ones(32), "nvfp4")
    with pytest.raises(ValueError, match="needs its float32 global_scale"):
        jaxmx.dequantize(jaxmx.MXArray(q.data, q.scale, "nvfp4", 0, (32,)))
    with pytest.raises(TypeError, match="global_scale must be float32"):
        jaxmx.dequantize(
            jaxmx.MXArray(q.data, q.scale, "nvfp4", 0, (32,), global_scale=jnp.ones(3))
        )
    with pytest.raises(ValueError, match="has no global_scale"):
        m = jaxmx.quantize(jnp.ones(32), "mxfp4")
        g = q.global_scale
        jaxmx.dequantize(jaxmx.MXArray(m.data, m.scale, "mxfp4", 0, (32,), global_scale=g))
