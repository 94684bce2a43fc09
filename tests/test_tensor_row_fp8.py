"""Per-tensor and per-row FP8 (``fp8_e4m3_tensor``, ``fp8_e5m2_tensor``, ``fp8_e4m3_row``,
``fp8_e5m2_row``) and their recipes, against an independent numpy + ml_dtypes model of torchao's
current scaling (``amax_to_scale``) in tests/reference.py."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference as ref
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmx
from jaxmx import recipes

TENSOR = ("fp8_e4m3_tensor", "fp8_e5m2_tensor")
ROW = ("fp8_e4m3_row", "fp8_e5m2_row")
TN = (((1,), (1,)), ((), ()))
EMULATE = dict(backend="emulate")


def assert_same_bits(got, want, uint):
    """Equal bit for bit, NaN against NaN (any payload)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    got_nan, want_nan = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(got_nan, want_nan)
    np.testing.assert_array_equal(got.view(uint)[~want_nan], want.view(uint)[~want_nan])


def adversarial_rows() -> np.ndarray:
    """[2, 7, 8] float32: zeros, subnormals, near float32 max, a span of 2^40, NaN, inf and
    ordinary rows along the last axis (and mixed along the others)."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((7, 8)).astype(np.float32)
    rows[0] = 0.0
    rows[1] = np.array([1e-40, -3e-42, 1.4e-45, 0, -1e-39, 2e-41, 5e-44, -7e-45], np.float32)
    rows[2] = np.array([3.4e38, -3.0e38, 1.0, -2.5e38, 1e30, 0, 3.3e38, -1e-3], np.float32)
    rows[3] = (rng.choice([-1.0, 1.0], 8) * 2.0 ** np.linspace(-20, 20, 8)).astype(np.float32)
    rows[4, 3] = np.nan
    rows[5, 6] = -np.inf
    return np.stack([rows, rng.standard_normal((7, 8)).astype(np.float32) * 1e-3])


def tensor_cases() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    ordinary = rng.standard_normal((3, 8)).astype(np.float32)
    cases = [ordinary, np.zeros((3, 8), np.float32)]
    cases.append(np.full((3, 8), -2e-41, np.float32))
    cases.append((ordinary * np.float32(1e38)).astype(np.float32))
    cases.append((ordinary * 2.0 ** rng.uniform(-20, 20, (3, 8))).astype(np.float32))
    for special in (np.nan, np.inf, -np.inf):
        c = ordinary.copy()
        c[1, 2] = special
        cases.append(c)
    return cases


# --- quantize / dequantize ----------------------------------------------------------------------


@pytest.mark.parametrize("scale_mode", ["fp32", "pow2"])
@pytest.mark.parametrize("fmt", ROW)
def test_per_row_quantization_matches_the_reference_on_every_axis(fmt, scale_mode):
    x = adversarial_rows()
    for axis in range(x.ndim):
        q = jaxmx.quantize(x, fmt, axis=axis, scale_mode=scale_mode)
        codes, scale = ref.current_fp8(x, fmt, axis, scale_mode)
        assert q.data.shape == x.shape and q.scale.shape == scale.shape, axis
        assert_same_bits(q.data, codes, np.uint8)
        assert_same_bits(q.scale, scale, np.uint32)
        assert_same_bits(jaxmx.dequantize(q), ref.current_fp8_decoded(codes, scale), np.uint32)


@pytest.mark.parametrize("scale_mode", ["fp32", "pow2"])
@pytest.mark.parametrize("fmt", TENSOR)
def test_per_tensor_quantization_matches_the_reference(fmt, scale_mode):
    for i, x in enumerate(tensor_cases()):
        q = jaxmx.quantize(x, fmt, axis=i % 2, scale_mode=scale_mode)
        codes, scale = ref.current_fp8(x, fmt, None, scale_mode)
        assert q.scale.shape == (1, 1), q.scale.shape
        assert_same_bits(q.data, codes, np.uint8)
        assert_same_bits(q.scale, scale, np.uint32)
        assert_same_bits(jaxmx.dequantize(q), ref.current_fp8_decoded(codes, scale), np.uint32)


def test_all_zero_and_nonfinite_tensors_give_the_documented_scales():
    zero = jaxmx.quantize(jnp.zeros((2, 4)), "fp8_e4m3_tensor")
    assert zero.scale.item() == np.float32(448.0 / 1e-12)
    assert (jaxmx.dequantize(zero) == 0).all()
    bad = jaxmx.quantize(jnp.array([[1.0, jnp.inf], [2.0, 3.0]]), "fp8_e5m2_row", axis=1)
    values = np.asarray(jaxmx.dequantize(bad))
    assert np.isnan(values[0]).all() and np.isfinite(values[1]).all()


@pytest.mark.parametrize("fmt", ["fp8_e4m3_tensor", "fp8_e5m2_row"])
def test_bfloat16_and_float16_inputs_quantize_as_their_float32_values(fmt):
    x = adversarial_rows()[1]  # finite
    for dtype in (jnp.bfloat16, jnp.float16):
        xl = jnp.asarray(x * 100, dtype)
        q = jaxmx.quantize(xl, fmt, axis=0)
        codes, scale = ref.current_fp8(np.asarray(xl.astype(jnp.float32)), fmt, 0)
        assert_same_bits(q.data, codes, np.uint8)
        assert_same_bits(q.scale, scale, np.uint32)
        assert jaxmx.dequantize(q, dtype).dtype == dtype


@pytest.mark.parametrize("fmt", TENSOR + ROW)
def test_fake_quantize_and_both_copies_equal_the_reference(fmt):
    x = adversarial_rows()[1]
    want_row = ref.current_fp8(x, fmt, 1)
    np.testing.assert_array_equal(
        jaxmx.fake_quantize(x, fmt, axis=1), ref.current_fp8_decoded(*want_row)
    )
    row, col_t = jaxmx.quantize_rowwise_colwise(jnp.asarray(x), fmt)
    codes, scale = ref.current_fp8(x.T, fmt, 1)
    assert_same_bits(row.data, want_row[0], np.uint8)
    assert_same_bits(col_t.data, codes, np.uint8)
    assert_same_bits(col_t.scale, scale, np.uint32)
    assert col_t.shape == x.T.shape and col_t.axis == 1


def test_stochastic_rounding_picks_a_neighbour_with_the_same_scale():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 64)), jnp.float32)
    q = jaxmx.quantize(x, "fp8_e4m3_row", axis=1, key=jax.random.key(0))
    _, scale = ref.current_fp8(np.asarray(x), "fp8_e4m3_row", 1)
    assert_same_bits(q.scale, scale, np.uint32)
    scaled = np.asarray(x) * scale
    got = np.asarray(q.data).astype(np.float32)
    down = np.asarray(jnp.asarray(scaled).astype(jnp.float8_e4m3fn)).astype(np.float32)
    grid = np.sort(np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)))
    grid = grid[np.isfinite(grid.astype(np.float32))].astype(np.float32)
    lo = grid[np.searchsorted(grid, scaled, side="right") - 1]
    hi = grid[np.minimum(np.searchsorted(grid, scaled, side="left"), grid.size - 1)]
    assert ((got == lo) | (got == hi)).all()
    assert (got != down).any()  # some rounded away from nearest


def test_what_has_no_meaning_for_one_scale_per_tensor_or_row_is_refused_by_name():
    x = jnp.ones((4, 32))
    with pytest.raises(ValueError, match=r"fp8_e4m3_tensor has one scale per tensor; tile="):
        jaxmx.quantize(x, "fp8_e4m3_tensor", tile=(1, 32))
    with pytest.raises(ValueError, match=r"fp8_e4m3_row has one scale per row; tile="):
        jaxmx.quantize(x, "fp8_e4m3_row", tile=(1, 32))
    with pytest.raises(NotImplementedError, match="pallas' has no kernel for fp8_e5m2_row"):
        jaxmx.quantize(x, "fp8_e5m2_row", impl="pallas")
    with pytest.raises(NotImplementedError, match="pallas' has no kernel for fp8_e4m3_tensor"):
        jaxmx.quantize_rowwise_colwise(x, "fp8_e4m3_tensor", impl="pallas")
    with pytest.raises(ValueError, match=r"block_stats covers .* not fp8_e4m3_row"):
        jaxmx.diagnostics.block_stats(x, "fp8_e4m3_row")
    with pytest.raises(ValueError, match="not the float32 scales of fp8_e4m3_tensor"):
        jaxmx.quantize_rowwise_colwise(x, "fp8_e4m3_tensor", swizzled_scales=True)
    with pytest.raises(TypeError):
        jaxmx.swizzle_scales(jaxmx.quantize(x, "fp8_e4m3_row").scale)
    with pytest.raises(ValueError, match="unknown scale_mode 'rceil' for fp8_e4m3_row"):
        jaxmx.quantize(x, "fp8_e4m3_row", scale_mode="rceil")


def test_mxarray_checks_the_scale_shapes_of_one_scale_per_tensor_or_row():
    q = jaxmx.quantize(jnp.ones((4, 32)), "fp8_e4m3_row", axis=0)
    assert q.scale.shape == (1, 32)
    with pytest.raises(ValueError, match=r"scales of shape \(1, 32\)"):
        jaxmx.MXArray(q.data, q.scale.T, q.fmt, 0, q.shape)
    t = jaxmx.quantize(jnp.ones((4, 32)), "fp8_e4m3_tensor")
    with pytest.raises(ValueError, match=r"scales of shape \(1, 1\)"):
        jaxmx.MXArray(t.data, jnp.ones((4, 1)), t.fmt, 1, t.shape)
    with pytest.raises(ValueError, match="one scale per tensor"):
        jaxmx.MXArray(t.data, t.scale, t.fmt, 1, t.shape, tile=(4, 32))
    batched = jax.vmap(lambda x: jaxmx.quantize(x, "fp8_e4m3_tensor"))(
        jnp.arange(6.0).reshape(2, 3)
    )
    assert batched.scale.shape == (2, 1)
    np.testing.assert_array_equal(
        jaxmx.dequantize(batched)[1],
        ref.current_fp8_decoded(*ref.current_fp8(np.arange(3.0, 6.0), "fp8_e4m3_tensor", None)),
    )


# --- recipes and the training GEMM ---------------------------------------------------------------


def ref_gemm(a, fa, a_axis, b, fb, b_axis, mode):
    """float64 ``a @ b.T`` of the reference-quantized operands (``a [M, K]``, ``b [N, K]``,
    each quantized along the given axis)."""
    da = ref.current_fp8_decoded(*ref.current_fp8(a, fa, a_axis, mode)).astype(np.float64)
    db = ref.current_fp8_decoded(*ref.current_fp8(b, fb, b_axis, mode)).astype(np.float64)
    return da @ db.T


def gemm_inputs():
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (8, 32)) * 3.0
    w = jax.random.normal(keys[1], (16, 32)) * 0.1
    g = jax.random.normal(keys[2], (8, 16)) * 1e-3
    return x, w, g


def vjp(recipe, x, w, g):
    y, pullback = jax.vjp(
        functools.partial(jaxmx.dot_general, dimension_numbers=TN, recipe=recipe), x, w
    )
    return y, *pullback(g)


@pytest.mark.parametrize("k_first", [False, True])  # w [N, K], or stored [K, N] (Flax)
@pytest.mark.parametrize("name", ["FP8_TENSORWISE", "FP8_ROWWISE"])
def test_forward_and_both_gradients_equal_the_float64_product_of_quantized_operands(name, k_first):
    r = getattr(recipes, name).replace(**EMULATE)
    x, w, g = (np.asarray(a) for a in gemm_inputs())
    if k_first:
        dims = (((1,), (0,)), ((), ()))
        y, pullback = jax.vjp(lambda x, w: jaxmx.dot_general(x, w, dims, recipe=r), x, w.T)
        dx, dw_t = pullback(g)
        dw = dw_t.T
    else:
        y, dx, dw = vjp(r, x, w, g)
    mode = r.scale_mode
    want_y = ref_gemm(x, r.fwd, 1, w, r.fwd, 1, mode)  # both along K
    want_dx = ref_gemm(g, r.grad, 1, w.T, r.fwd, 1, mode)  # g along N, w along N
    want_dw = ref_gemm(g.T, r.grad, 1, x.T, r.fwd, 1, mode)  # g along M, x along M
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6 * np.abs(want).max())


def test_per_tensor_quantizes_each_operand_once_and_saves_one_copy():
    x, w, g = gemm_inputs()
    f = functools.partial(jaxmx.dot_general, dimension_numbers=TN)

    def amax_reductions(recipe):
        """The reductions that read a whole operand (an amax; later steps of a reduction in
        steps read less)."""
        jaxpr = jax.make_jaxpr(
            lambda x, w: jax.vjp(functools.partial(f, recipe=recipe), x, w)[1](g)
        )
        sizes = {x.size, w.size, g.size}
        return sum(
            eqn.invars[0].aval.size in sizes
            for eqn in _equations(jaxpr(x, w).jaxpr)
            if eqn.primitive.name == "reduce_max"
        )

    tensorwise = recipes.FP8_TENSORWISE.replace(**EMULATE)
    assert amax_reductions(tensorwise) == 3  # x, w and g: each quantized once
    assert amax_reductions(recipes.FP8_ROWWISE.replace(**EMULATE)) == 6  # two copies each
    _, pullback = jax.vjp(functools.partial(f, recipe=tensorwise), x, w)
    saved = sum(leaf.nbytes for leaf in jax.tree.leaves(pullback))
    assert saved == x.size + w.size + 2 * 4  # one byte per element, one float32 scale each
    hp = tensorwise.replace(residuals="high_precision")
    _, pullback = jax.vjp(functools.partial(f, recipe=hp), x, w)
    assert sum(leaf.nbytes for leaf in jax.tree.leaves(pullback)) == 4 * (x.size + w.size)


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs it calls."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_rowwise_with_high_precision_wgrad_gives_the_unquantized_weight_gradient():
    r = recipes.FP8_ROWWISE_GW_HP.replace(**EMULATE)
    x, w, g = (np.asarray(a) for a in gemm_inputs())
    _, dx, dw = vjp(r, x, w, g)
    np.testing.assert_allclose(dw, g.T.astype(np.float64) @ x, rtol=1e-5, atol=1e-7)
    want_dx = ref_gemm(g, r.grad, 1, w.T, r.fwd, 1, "pow2")
    np.testing.assert_allclose(dx, want_dx, rtol=2e-6, atol=1e-6 * np.abs(want_dx).max())


def test_recipe_options_work_or_are_refused_by_name():
    x, w, g = gemm_inputs()
    rowwise = vjp(recipes.FP8_ROWWISE.replace(**EMULATE), x, w, g)
    for r in (  # the same quantizations, saved or recomputed; "auto" emulates on the CPU
        recipes.FP8_ROWWISE.replace(residuals="high_precision", **EMULATE),
        recipes.FP8_ROWWISE.replace(backend="auto"),
    ):
        jax.tree.map(np.testing.assert_array_equal, vjp(r, x, w, g), rowwise)
    exact_dw = np.asarray(g).T.astype(np.float64) @ np.asarray(x)
    for r in (
        recipes.FP8_TENSORWISE.replace(rht=True),
        recipes.FP8_TENSORWISE.replace(grad="fp8_e4m3_block"),  # mixed kinds: dequantized GEMM
        recipes.MXFP8.replace(wgrad="high_precision"),
    ):
        dw = vjp(r.replace(**EMULATE), x, w, g)[2]
        np.testing.assert_allclose(dw, exact_dw, atol=0.1 * np.abs(exact_dw).max())
    stochastic = recipes.FP8_TENSORWISE.replace(grad_rounding="stochastic", **EMULATE)

    def loss(x, w, key):
        return (jaxmx.dot_general(x, w, TN, recipe=stochastic, key=key) * g).sum()

    dw = jax.grad(loss, 1)(x, w, jax.random.key(0))
    np.testing.assert_allclose(dw, exact_dw, atol=0.25 * np.abs(exact_dw).max())  # E5M2
    nearest = vjp(recipes.FP8_TENSORWISE.replace(**EMULATE), x, w, g)[2]
    assert not np.array_equal(dw, nearest)
    with pytest.raises(ValueError, match=r"fp8_e4m3_row has one scale per row, no 2-D tiles"):
        recipes.FP8_ROWWISE.replace(weight_tile=(128, 128))
    with pytest.raises(ValueError, match="wgrad='high_precision' nothing is quantized"):
        recipes.FP8_ROWWISE_GW_HP.replace(rht=True)
    with pytest.raises(ValueError, match="accum_bits models MX GEMMs only"):
        recipes.FP8_TENSORWISE.replace(accum_bits=14)
    with pytest.raises(ValueError, match="unknown scale_mode 'fp32' for mxfp8_e5m2"):
        recipes.FP8_TENSORWISE.replace(grad="mxfp8_e5m2")
    with pytest.raises(ValueError, match=r"unknown Recipe\.wgrad"):
        recipes.MXFP8.replace(wgrad="fp32")
    with pytest.raises(
        ValueError, match=r"fp8_e4m3_tensor has one scale per tensor; lax.scaled_dot"
    ):
        recipes.FP8_TENSORWISE.replace(backend="xla")
    e5m2 = recipes.FP8_TENSORWISE.replace(fwd="fp8_e5m2_tensor", backend="ffi")
    with pytest.raises(NotImplementedError, match=r"fp8_e5m2_tensor x fp8_e5m2_tensor is not"):
        jaxmx.dot_general(x, w, TN, recipe=e5m2)  # no such cuBLASLt kernel
    with pytest.raises(
        NotImplementedError, match=r"fp8_e4m3_tensor .one scale per tensor. has no grouped"
    ):
        jaxmx.grouped_recipe(recipes.FP8_TENSORWISE)
    with pytest.raises(NotImplementedError, match="wgrad='high_precision' is not available"):
        jaxmx.grouped_recipe(recipes.MXFP8.replace(wgrad="high_precision"))


def test_under_jit_a_sharded_tensor_gets_the_global_amax():
    """GSPMD reduces the amax over the shards: the bytes of the unsharded quantization."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), devices=jax.devices()[:8])
    x = adversarial_rows()[1]  # [7, 8]: finite
    x = np.concatenate([x, x * 1e3])  # [14, 8], the largest rows on the second shard
    sharded = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
    for fmt, axis in (("fp8_e4m3_tensor", 1), ("fp8_e5m2_row", 0), ("fp8_e4m3_row", 1)):
        q = jax.jit(lambda x: jaxmx.quantize(x, fmt, axis=axis))(sharded)  # noqa: B023
        codes, scale = ref.current_fp8(x, fmt, axis)
        assert_same_bits(q.data, codes, np.uint8)
        assert_same_bits(q.scale, scale, np.uint32)
