"""The NVFP4 GEMM emulation against numpy, and the NVFP4 / MXFP4 training recipes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxmx

DIMS = (((1,), (1,)), ((), ()))


def units(q) -> np.ndarray:
    """float64 ``code * s`` of an NVFP4 MXArray blocked along its last axis, in 1-D blocks or
    16x16 tiles (numpy decode)."""
    codes = np.asarray(q.data).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = np.asarray(q.scale).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    if q.tile is not None:
        s = np.repeat(s, 16, axis=-2)
    return codes * np.repeat(s, 16, axis=-1)


def test_emulated_gemm_is_alpha_times_the_unit_dot_exactly():
    """Values on the E2M1 grid with block maxima of 6 give s = 448 and codes = x: every partial
    sum is exact in float32, so the emulation must equal float32(alpha * acc) bit for bit."""
    rng = np.random.default_rng(0)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    a = rng.choice(grid, (2, 8, 64)) * rng.choice([-1, 1], (2, 8, 64))
    b = rng.choice(grid, (2, 12, 64)) * rng.choice([-1, 1], (2, 12, 64))
    a[..., ::16], b[..., ::16] = 6.0, -6.0
    qa, qb = jaxmx.quantize(a, "nvfp4"), jaxmx.quantize(b, "nvfp4")
    assert (np.asarray(qa.scale).astype(np.float32) == 448).all()
    acc = np.einsum("bmk,bnk->bmn", units(qa), units(qb)).astype(np.float32)
    alpha = np.float32(qa.global_scale) * np.float32(qb.global_scale)
    want = alpha * acc
    got = np.asarray(jaxmx.matmul(qa, qb, jnp.float32, backend="emulate"))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_emulated_gemm_on_random_operands():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((24, 72)).astype(np.float32) * 2.0 ** rng.integers(-10, 10, (24, 1))
    w = rng.standard_normal((40, 72)).astype(np.float32)
    qa, qb = jaxmx.quantize(x, "nvfp4"), jaxmx.quantize(w, "nvfp4", tile=(16, 16))
    ua, ub = units(qa)[:, :72], units(qb)[:40, :72]
    products = np.abs(ua) @ np.abs(ub).T
    alpha = float(np.float32(qa.global_scale) * np.float32(qb.global_scale))
    want = alpha * (ua @ ub.T)
    got = np.asarray(jaxmx.matmul(qa, qb, jnp.float32))
    np.testing.assert_array_less(np.abs(got - want), alpha * products * 2.0**-20 + 1e-30)


def test_nan_block_gives_nan_rows():
    x = np.ones((4, 32), np.float32)
    x[2, 20] = np.inf
    q = jaxmx.quantize(x, "nvfp4", global_scale=1 / 2688)
    out = np.asarray(jaxmx.matmul(q, jaxmx.quantize(np.ones((3, 32), np.float32), "nvfp4")))
    assert np.isnan(out[2]).all() and not np.isnan(np.delete(out, 2, axis=0)).any()


def test_nvfp4_recipe_forward_and_input_gradient_share_the_weight_tiles():
    recipe = jaxmx.recipes.NVFP4.replace(grad_rounding="nearest")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((32, 48)).astype(np.float32)
    w = rng.standard_normal((40, 48)).astype(np.float32)
    g = rng.standard_normal((32, 40)).astype(np.float32)
    y, vjp = jax.vjp(lambda x, w: jaxmx.dot_general(x, w, DIMS, recipe=recipe), x, w)
    dx, _ = vjp(g)
    w_tiles = jaxmx.quantize(w[None], "nvfp4", tile=(16, 16))
    want_y = jaxmx.matmul(jaxmx.quantize(x[None], "nvfp4"), w_tiles, jnp.float32)[0]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
    w_t = jaxmx.MXArray(  # the same bytes, transposed: [K, N] tiled, blocked along N
        w_tiles.data.swapaxes(-1, -2),
        w_tiles.scale.swapaxes(-1, -2),
        "nvfp4",
        2,
        (1, 48, 40),
        (16, 16),
        w_tiles.global_scale,
    )
    want_dx = jaxmx.matmul(jaxmx.quantize(g[None], "nvfp4"), w_t, jnp.float32)[0]
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(want_dx))


@pytest.mark.parametrize("name", ["NVFP4", "MXFP4"])
def test_recipes_train_a_regression(name):
    """Stochastic rounding, RHT and weight tiles together: a least-squares fit converges."""
    recipe = getattr(jaxmx.recipes, name)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    w_true = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    y = x @ w_true.T

    def loss(w, key):
        pred = jaxmx.dot_general(x, w, DIMS, recipe=recipe, key=key)
        return jnp.sum((pred - y) ** 2) / len(x)

    step = jax.jit(lambda w, key: w - 0.2 * jax.grad(loss)(w, key))
    w = jnp.zeros_like(w_true)
    for i in range(150):
        w = step(w, jax.random.key(i))
    error = float(jnp.linalg.norm(w - w_true) / jnp.linalg.norm(w_true))
    assert error < 0.25, error  # float32: 5e-5; the 4-bit forward's noise floor: 0.12-0.17


def test_recipe_errors():
    with pytest.raises(ValueError, match=r"\(16, 16\) for nvfp4"):
        jaxmx.Recipe(fwd="nvfp4", grad="nvfp4", scale_mode="e4m3", weight_tile=(32, 32))
    with pytest.raises(ValueError, match="unknown scale_mode 'rceil' for nvfp4"):
        jaxmx.Recipe(fwd="nvfp4", grad="nvfp4")
    with pytest.raises(TypeError, match=r"Recipe\.rht must be"):
        jaxmx.Recipe(rht=1)
    with pytest.raises(TypeError, match=r"Recipe\.rht_seed must be an int"):
        jaxmx.Recipe(rht=True, rht_seed=1.5)
    with pytest.raises(ValueError, match="accum_bits models MX GEMMs only"):
        jaxmx.recipes.NVFP4.replace(accum_bits=14)
