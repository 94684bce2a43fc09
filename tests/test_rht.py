"""The random Hadamard transform, against a numpy Sylvester matrix, and inside the wgrad GEMM."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmx


def sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def reference_rht(x: np.ndarray, axis: int, signs: np.ndarray) -> np.ndarray:
    """float64 ``H diag(signs) v / sqrt(n)`` for each block ``v`` along ``axis`` (zero-padded)."""
    n = len(signs)
    moved = np.moveaxis(x.astype(np.float64), axis, -1)
    moved = np.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, -moved.shape[-1] % n)])
    blocks = moved.reshape(*moved.shape[:-1], -1, n)
    out = (blocks * signs) @ (sylvester(n) / np.sqrt(n)).T
    return np.moveaxis(out.reshape(moved.shape), -1, axis)


@pytest.mark.parametrize(
    "shape, axis, size",
    [((40, 3), 0, 16), ((2, 5, 64), -1, 16), ((7, 24), 1, 8), ((3, 64), -1, 32)],
)
def test_matches_reference(shape, axis, size):
    key = jax.random.key(4)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    signs = np.asarray(jax.random.rademacher(key, (size,), jnp.float32), np.float64)
    want = reference_rht(x, axis, signs)
    got = np.asarray(jaxmx.rht(x, axis, key, size))
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(x).max())


def test_inverse_returns_the_input():
    x = np.random.default_rng(1).standard_normal((3, 48, 5)).astype(np.float32) * 100
    key = jax.random.key(2)
    back = jaxmx.rht(jaxmx.rht(x, 1, key), 1, key, inverse=True)
    np.testing.assert_allclose(np.asarray(back), x, rtol=0, atol=4e-7 * np.abs(x).max())
    signs_differ = jaxmx.rht(jaxmx.rht(x, 1, key), 1, jax.random.key(3), inverse=True)
    assert not np.allclose(np.asarray(signs_differ), x, atol=1e-3)


def test_the_product_along_the_transformed_axis_is_unchanged():
    """(R a)^T (R b) = a^T b: the transform cancels in a GEMM reducing the transformed axis,
    zero padding of a length that is not a multiple of 16 included."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((50, 6)).astype(np.float32)
    b = rng.standard_normal((50, 9)).astype(np.float32)
    a[7, 2] = 1e3  # an outlier
    key = jax.random.key(0)
    ra, rb = np.asarray(jaxmx.rht(a, 0, key), np.float64), np.asarray(jaxmx.rht(b, 0, key))
    want = a.astype(np.float64).T @ b.astype(np.float64)
    np.testing.assert_allclose(ra.T @ rb, want, rtol=0, atol=1e-6 * np.abs(a).max() * 50)


def test_spreads_an_outlier_over_its_block():
    x = np.zeros((32, 2), np.float32)
    x[5, 0] = 64.0
    y = np.asarray(jaxmx.rht(x, 0, jax.random.key(9)))
    assert (np.abs(y[:16, 0]) == 16.0).all() and not y[16:, 0].any() and not y[:, 1].any()


def test_errors():
    with pytest.raises(ValueError, match="power of two"):
        jaxmx.rht(jnp.ones(12), 0, jax.random.key(0), size=12)
    with pytest.raises(TypeError, match="PRNG key"):
        jaxmx.rht(jnp.ones(16), 0, 3)
    with pytest.raises(TypeError, match="dtype"):
        jaxmx.rht(jnp.ones(16, jnp.int32), 0, jax.random.key(0))
    with pytest.raises(ValueError, match="out of range"):
        jaxmx.rht(jnp.ones(16), 1, jax.random.key(0))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_wgrad_gemm_runs_on_transformed_operands(fmt):
    """dot_general's weight gradient with ``rht`` is the GEMM of the transformed, quantized
    operands along M; the forward and the input gradient do not see the transform."""
    recipe = getattr(jaxmx.recipes, fmt.upper()).replace(grad_rounding="nearest")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 64)).astype(np.float32)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    g = rng.standard_normal((40, 48)).astype(np.float32)
    dims = (((1,), (1,)), ((), ()))
    _, vjp = jax.vjp(lambda x, w: jaxmx.dot_general(x, w, dims, recipe=recipe), x, w)
    dx, dw = vjp(g)
    _, vjp_plain = jax.vjp(
        lambda x, w: jaxmx.dot_general(x, w, dims, recipe=recipe.replace(rht=False)), x, w
    )
    dx_plain, dw_plain = vjp_plain(g)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_plain))
    key = jax.random.key(recipe.rht_seed)
    g_col = jaxmx.quantize(jaxmx.rht(g[None], 1, key), fmt, axis=1)
    x_col = jaxmx.quantize(jaxmx.rht(x[None], 1, key), fmt, axis=1)
    want = jaxmx.matmul(g_col, x_col, jnp.float32, backend="emulate")[0]
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(want))
    assert not np.array_equal(np.asarray(dw), np.asarray(dw_plain))
