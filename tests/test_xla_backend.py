"""backend="xla": jaxmx GEMMs through jax.lax.scaled_dot (its CPU decomposition here).

Every GEMM is checked against an exact float64 product of the decoded codes and scales (numpy and
ml_dtypes): equal where every partial sum is exact in float32 (small-integer-valued operands),
within docs/native.md's bound otherwise (tests/bounds.py); and against the emulation, bit for
bit.
"""

from __future__ import annotations

import bounds
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmx
import jaxmx.flax.linen
from jaxmx import recipes

TN = (((1,), (1,)), ((), ()))
PAIRS = [
    ("mxfp8_e4m3", "mxfp8_e4m3"),
    ("mxfp8_e5m2", "mxfp8_e5m2"),
    ("mxfp8_e4m3", "mxfp8_e5m2"),
    ("mxfp4", "mxfp4"),
    ("mxfp4", "mxfp8_e4m3"),
    ("nvfp4", "nvfp4"),
]
RECIPES = ["MXFP8", "MXFP8_HYBRID", "MXFP8_2D", "FP8_BLOCK_POW2", "NVFP4", "MXFP4"]


def decoded(q: jaxmx.MXArray) -> np.ndarray:
    """float64 values of an MXArray in 1-D blocks, its tensor scale left out: codes times their
    block scales, the padding along K cut, laid out like ``q.data``."""
    k = q.data_axis % q.data.ndim
    codes = np.asarray(q.data).astype(np.float64)
    scale = np.repeat(np.asarray(q.scale).astype(np.float64), q.format.block, axis=k)
    return np.take(codes * scale, np.arange(q.shape[q.axis]), axis=k)


def alpha(a: jaxmx.MXArray, b: jaxmx.MXArray) -> np.float32:
    """The tensor scales' float32 product g_a * g_b (1 without them), as cuBLASLt's alpha."""
    g = [np.float32(1) if q.global_scale is None else np.float32(q.global_scale) for q in (a, b)]
    return g[0] * g[1]


def reference(a: jaxmx.MXArray, b: jaxmx.MXArray) -> np.ndarray:
    """The exact product (float64) of two 2-D operands, each [rows, K] or [K, rows], before the
    tensor scales."""
    av, bv = decoded(a), decoded(b)
    av = av if a.data_axis % 2 else av.T
    bv = bv if b.data_axis % 2 else bv.T
    return av @ bv.T


def small_integers(key, shape, top):
    return jax.random.randint(key, shape, -top, top + 1).astype(jnp.float32)


# --- the GEMM -------------------------------------------------------------------------------


def test_the_backend_name_is_a_contract():
    assert "xla" in jaxmx.BACKENDS
    assert jaxmx.Recipe(backend="xla").backend == "xla"


@pytest.mark.parametrize("formats", PAIRS, ids="x".join)
@pytest.mark.parametrize("k_first", [False, True], ids=["tn", "b_k_first"])
def test_matmul_is_exact_on_exact_sums_and_equals_the_emulation(formats, k_first):
    """K = 80 (padded to whole blocks), b stored [N, K] or K-first [K, N]."""
    ka, kb = jax.random.split(jax.random.key(0))
    x, w = small_integers(ka, (4, 80), 6), small_integers(kb, (5, 80), 6)
    a = jaxmx.quantize(x, formats[0])
    b = jaxmx.quantize(w.T, formats[1], axis=0) if k_first else jaxmx.quantize(w, formats[1])
    got = np.asarray(jaxmx.matmul(a, b, jnp.float32, backend="xla"))
    want = reference(a, b).astype(np.float32) * alpha(a, b)
    np.testing.assert_array_equal(got, want)
    emulated = jaxmx.matmul(a, b, jnp.float32, backend="emulate")
    np.testing.assert_array_equal(got, np.asarray(emulated))


@pytest.mark.parametrize("formats", PAIRS, ids="x".join)
def test_matmul_on_normal_inputs_within_float32_summation(formats):
    ka, kb = jax.random.split(jax.random.key(1))
    a = jaxmx.quantize(jax.random.normal(ka, (2, 3, 64)), formats[0])
    b = jaxmx.quantize(jax.random.normal(kb, (2, 4, 64)), formats[1])
    got = np.asarray(jaxmx.matmul(a, b, jnp.float32, backend="xla"))
    for i in range(2):
        ai = jaxmx.MXArray(
            a.data[i], a.scale[i], a.fmt, 1, a.shape[1:], global_scale=a.global_scale
        )
        bi = jaxmx.MXArray(
            b.data[i], b.scale[i], b.fmt, 1, b.shape[1:], global_scale=b.global_scale
        )
        want = reference(ai, bi) * alpha(ai, bi)
        # docs/native.md's bound: float32 accumulation of the exact products, alpha's product
        # among its further roundings, then the rounding to float32
        abs_sum = bounds.abs_products(decoded(ai), decoded(bi)) * alpha(ai, bi)
        bounds.assert_within(got[i], want, bounds.against_exact(abs_sum, 64, want), str(i))
    emulated = jaxmx.matmul(a, b, jnp.float32, backend="emulate")
    np.testing.assert_array_equal(got, np.asarray(emulated))


def _mx(codes, scale_exponents, fmt="mxfp8_e4m3"):
    """A 1-row-per-block MXArray [rows, 32 * blocks] from codes and E8M0 exponents (None: NaN)."""
    f = jaxmx.FORMATS[fmt]
    data = jnp.asarray(np.asarray(codes, np.float32).astype(f.dtype))
    e8m0 = np.array(
        [[np.nan if e is None else 2.0**e for e in row] for row in scale_exponents], np.float64
    ).astype(ml_dtypes.float8_e8m0fnu)
    return jaxmx.MXArray(data, jnp.asarray(e8m0), fmt, 1, data.shape)


def test_scales_at_the_ends_of_the_e8m0_range_stay_exact():
    """A block at 2^127: code * scale overflows bfloat16 in lax.scaled_dot's decomposition
    (plain lax.scaled_dot gives inf) unless the scales are folded (relative to each row's
    largest, 2^(s_a + s_b) multiplied back in float32)."""
    codes = np.tile(np.array([1.5, -2.0, 448.0, 0.25] * 8), (2, 2))  # [2, 64]
    a = _mx(codes, [[127, -100], [100, 90]])
    b = _mx(codes[:, ::-1] / 8, [[-126, -120], [-115, -110]])
    plain = jax.lax.scaled_dot(
        a.data,
        b.data,
        lhs_scale=a.scale,
        rhs_scale=b.scale,
        dimension_numbers=TN,
        preferred_element_type=jnp.float32,
    )
    assert np.isinf(np.asarray(plain)).any()
    got = np.asarray(jaxmx.matmul(a, b, jnp.float32, backend="xla"))
    np.testing.assert_array_equal(got, reference(a, b).astype(np.float32))
    np.testing.assert_array_equal(got, np.asarray(jaxmx.matmul(a, b, jnp.float32, "emulate")))


def test_a_block_beyond_e8m0_range_of_its_row_enters_as_zero():
    """A block 2^-147 below its row's largest is zeroed (its products are below 2^-110 of the
    row's, documented): the result is still the exact one rounded to float32."""
    codes = np.ones((1, 64))
    a = _mx(codes, [[100, -47]])
    b = _mx(codes, [[0, 0]])
    got = np.asarray(jaxmx.matmul(a, b, jnp.float32, backend="xla"))
    np.testing.assert_array_equal(got, reference(a, b).astype(np.float32))


def test_nan_scales_and_e5m2_infinities_propagate_like_the_emulation():
    codes = np.ones((3, 64))
    codes[2, 5] = np.inf
    a = _mx(codes, [[0, None], [0, 3], [1, 1]], "mxfp8_e5m2")
    b = _mx(np.ones((2, 64)), [[0, 0], [2, -4]], "mxfp8_e5m2")
    got = np.asarray(jaxmx.matmul(a, b, jnp.float32, backend="xla"))
    assert np.isnan(got[0]).all() and np.isposinf(got[2]).all() and np.isfinite(got[1]).all()
    np.testing.assert_array_equal(got[1], reference(a, b)[1].astype(np.float32))
    np.testing.assert_array_equal(got, np.asarray(jaxmx.matmul(a, b, jnp.float32, "emulate")))


# --- the training GEMMs -----------------------------------------------------------------------


def _step(recipe, key=None):
    """(y, dx, dw) of y = x @ w.T through jaxmx.dot_general, jitted."""

    def layer(x, w):
        return jaxmx.dot_general(
            x, w, TN, preferred_element_type=jnp.float32, recipe=recipe, key=key
        )

    def step(x, w, ct):
        y, backward = jax.vjp(layer, x, w)
        return y, *backward(ct)

    return jax.jit(step)


def _layer_inputs(k=256):
    keys = jax.random.split(jax.random.key(2), 3)
    return (
        small_integers(keys[0], (32, k), 4),
        small_integers(keys[1], (32, k), 4),
        small_integers(keys[2], (32, 32), 4),
    )


@pytest.mark.parametrize("name", RECIPES)
def test_forward_and_gradients_equal_the_emulation_bit_for_bit(name):
    """Every preset it takes (FP8_BLOCK_POW2 as its MXFP8 twin, NVFP4 and MXFP4 with their
    Hadamard transform, tiles and stochastic rounding): y, dx and dw."""
    recipe = getattr(recipes, name)
    key = jax.random.key(3) if recipe.grad_rounding == "stochastic" else None
    args = _layer_inputs(128)
    got = _step(recipe.replace(backend="xla"), key)(*args)
    want = _step(recipe.replace(backend="emulate"), key)(*args)
    for g, w, what in zip(got, want, ("y", "dx", "dw"), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{name} {what}")


def test_vmap_of_the_training_gemm_equals_the_emulation():
    x, w, ct = _layer_inputs(64)
    xs = jnp.stack([x, -x, x / 2])
    run = lambda backend: jax.vmap(_step(recipes.MXFP8.replace(backend=backend)), (0, None, None))
    for g, e in zip(run("xla")(xs, w, ct), run("emulate")(xs, w, ct), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_einsum_and_attention_take_it():
    x, w, _ = _layer_inputs(64)
    r = recipes.MXFP8.replace(backend="xla")
    e = recipes.MXFP8.replace(backend="emulate")
    np.testing.assert_array_equal(
        np.asarray(jaxmx.einsum("mk,nk->mn", x, w, recipe=r)),
        np.asarray(jaxmx.einsum("mk,nk->mn", x, w, recipe=e)),
    )
    q = x.reshape(1, 32, 1, 64)
    attend = lambda recipe: jaxmx.dot_product_attention(q, q, q, recipe=recipe)
    np.testing.assert_array_equal(np.asarray(attend(r)), np.asarray(attend(e)))


def test_a_flax_dense_layer_trains_like_the_emulation():
    x, _, _ = _layer_inputs(64)
    layer = lambda backend: jaxmx.flax.linen.Dense(
        32, recipe=recipes.MXFP8.replace(backend=backend)
    )
    params = layer("emulate").init(jax.random.key(4), x)
    grads = {
        b: jax.grad(lambda p, b=b: layer(b).apply(p, x).sum())(params) for b in ("xla", "emulate")
    }
    jax.tree.map(np.testing.assert_array_equal, grads["xla"], grads["emulate"])


def test_the_composite_survives_jax_export_of_a_training_step():
    args = _layer_inputs(64)
    step = _step(recipes.MXFP8.replace(backend="xla"))
    restored = jax.export.deserialize(jax.export.export(step)(*args).serialize())
    assert restored.mlir_module().count('stablehlo.composite "xla.scaled_dot"') == 3
    for g, w in zip(restored.call(*args), step(*args), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_an_export_for_several_platforms_fails_in_jax_itself():
    """Pins a JAX limitation (jax 0.10.2) that docs/training_gemm.md states: lowered for several
    platforms at once, ``lax.scaled_dot``'s composite fails MLIR verification (its
    decomposition gets the platform-index argument). Plain ``lax.scaled_dot``, no jaxmx, fails
    the same way; when this test fails, JAX has fixed it and the docs' limit can go."""
    a, b = jnp.ones((1, 8, 64), jnp.float8_e4m3fn), jnp.ones((1, 16, 64), jnp.float8_e4m3fn)
    sa, sb = jnp.ones((1, 8, 2), jnp.float8_e8m0fnu), jnp.ones((1, 16, 2), jnp.float8_e8m0fnu)
    dims = (((2,), (2,)), ((0,), (0,)))

    def plain(a, b, sa, sb):
        return jax.lax.scaled_dot(a, b, lhs_scale=sa, rhs_scale=sb, dimension_numbers=dims)

    args = _layer_inputs(64)
    step = _step(recipes.MXFP8.replace(backend="xla"))
    jax.export.export(step, platforms=("cpu",))(*args)  # one platform: fine
    for fn, fn_args in ((jax.jit(plain), (a, b, sa, sb)), (step, args)):
        with pytest.raises(ValueError, match="decomposition has"):
            jax.export.export(fn, platforms=("cpu", "cuda"))(*fn_args)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest.py)")
def test_data_parallel_on_8_devices_equals_one_device():
    mesh = jax.make_mesh((8,), ("data",))
    x, w, ct = _layer_inputs(64)
    step = _step(recipes.MXFP8.replace(backend="xla"))
    sh = NamedSharding(mesh, P("data"))
    rep = NamedSharding(mesh, P())
    sharded = jax.jit(step, in_shardings=(sh, rep, sh))(x, w, ct)
    one = _step(recipes.MXFP8.replace(backend="emulate"))(
        *jax.device_put((x, w, ct), jax.devices()[0])
    )
    for g, e in zip(sharded, one, strict=True):  # integer-valued: every split sum is exact
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


# --- what it refuses --------------------------------------------------------------------------


def test_float32_block_scales_are_refused_by_name():
    with pytest.raises(ValueError, match=r"backend='xla'.*float32 block scales"):
        recipes.DEEPSEEK_FP8.replace(backend="xla")
    q = jaxmx.quantize(jnp.ones((2, 128)), "fp8_e4m3_block", scale_mode="pow2")
    with pytest.raises(ValueError, match=r"backend='xla'.*scale_mode=None"):
        jaxmx.matmul(q, q, backend="xla")


def test_mixed_scale_kinds_tiles_accumulators_and_grouped_gemms_are_refused():
    a = jaxmx.quantize(jnp.ones((2, 64)), "mxfp8_e4m3")
    n = jaxmx.quantize(jnp.ones((2, 64)), "nvfp4")
    with pytest.raises(ValueError, match=r"mxfp8_e4m3 x nvfp4 mixes scale kinds"):
        jaxmx.matmul(a, n, backend="xla")
    with pytest.raises(ValueError, match=r"accum_bits .* backend 'xla' cannot take it"):
        jaxmx.Recipe(backend="xla", accum_bits=14)
    with pytest.raises(ValueError, match=r"accum_bits .* backend 'xla' cannot take it"):
        jaxmx.matmul(a, a, backend="xla", accum_bits=14)
    ones = jnp.ones((64, 64))
    wide = jaxmx.quantize(ones, "mxfp8_e4m3", tile=(32, 64))
    with pytest.raises(ValueError, match=r"backend='xla': tiles .* have no 1-D form"):
        jaxmx.matmul(wide, wide, backend="xla")
    with pytest.raises(NotImplementedError, match=r"ragged_dot: backend='xla' has no grouped"):
        jaxmx.grouped_recipe(recipes.MXFP8.replace(backend="xla"))
    rows = jaxmx.quantize(ones, "mxfp8_e4m3", tile=(64, 32))  # block-wide tiles: taken
    got = jaxmx.matmul(rows, jaxmx.quantize(ones, "mxfp8_e4m3"), jnp.float32, backend="xla")
    np.testing.assert_array_equal(np.asarray(got), np.full((64, 64), 64.0))
