"""jaxmx.ragged_dot: the MX definition of each GEMM (numpy reference) and jax.lax.ragged_dot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import jaxmx
from jaxmx import diagnostics

QUANTIZED_NAMES = (jaxmx.LHS_COLWISE, jaxmx.RHS_COLWISE)
INPUT_NAMES = (jaxmx.LHS_INPUT, jaxmx.RHS_INPUT)

SIZES = np.array([0, 1, 31, 33, 100])  # group sizes; 5 more rows past the last group
M, K, N = int(SIZES.sum()) + 5, 64, 48


def qdq(x, axis):
    """x quantized to MXFP8 E4M3 (rceil) along ``axis`` and decoded, by tests/reference.py."""
    x = np.asarray(x, np.float32)
    data, scale = ref.quantize(x, "mxfp8_e4m3", "rceil", axis=axis)
    return ref.dequantize(data, scale, axis, x.shape)


def groups(sizes):
    """(start, stop) of each group's rows."""
    ends = np.cumsum(sizes)
    return list(zip(ends - sizes, ends, strict=True))


def inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(keys[0], (M, K))
    rhs = jax.random.normal(keys[1], (len(SIZES), K, N)) * K**-0.5
    g = jax.random.normal(keys[2], (M, N))
    return lhs, rhs, g


def reference_vjp(lhs, rhs, g, sizes):
    """Each GEMM from its own MX copies: out and dlhs row by row, drhs group by group (each
    group's tokens quantized along M on their own, zero-padded to whole blocks)."""
    (m, k), n = np.shape(lhs), np.shape(rhs)[-1]
    out, dlhs = np.zeros((m, n)), np.zeros((m, k))
    drhs = np.zeros((len(sizes), k, n))
    lq, gq = qdq(lhs, 1), qdq(g, 1)
    for j, (a, b) in enumerate(groups(sizes)):
        out[a:b] = lq[a:b] @ qdq(rhs[j], 0)
        dlhs[a:b] = gq[a:b] @ qdq(rhs[j], 1).T
        if b > a:
            drhs[j] = qdq(lhs[a:b], 0).T @ qdq(g[a:b], 0)
    return out, dlhs, drhs


def mx_vjp(lhs, rhs, g, sizes, recipe=jaxmx.recipes.MXFP8, key=None):
    @jax.jit
    def run(lhs, rhs, g, sizes):  # group sizes traced
        f = lambda a, b: jaxmx.ragged_dot(a, b, sizes, recipe=recipe, key=key)
        out, pullback = jax.vjp(f, lhs, rhs)
        return (out, *pullback(g))

    return run(lhs, rhs, g, jnp.asarray(sizes))


@pytest.mark.parametrize("residuals", ["quantized", "high_precision"])
def test_every_gemm_is_the_mx_definition(residuals):
    lhs, rhs, g = inputs()
    recipe = jaxmx.recipes.MXFP8.replace(residuals=residuals)
    for got, want in zip(
        mx_vjp(lhs, rhs, g, SIZES, recipe), reference_vjp(lhs, rhs, g, SIZES), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_in_shard_map_each_device_runs_its_own_groups():
    """Experts replicated over 8 devices, each device with its own tokens and group sizes:
    out and dlhs are each device's numpy reference, drhs the sum of the devices' references
    (summed over the axis, as autodiff does for a replicated input)."""
    mesh = jax.make_mesh((8,), ("ep",))
    P = jax.sharding.PartitionSpec
    rng = np.random.default_rng(0)
    sizes = rng.multinomial(36, np.ones(len(SIZES)) / len(SIZES), size=8)  # 4 rows left over
    lhs = jax.random.normal(jax.random.key(0), (8 * 40, K))
    rhs = jax.random.normal(jax.random.key(1), (len(SIZES), K, N)) * K**-0.5
    g = jax.random.normal(jax.random.key(2), (8 * 40, N))

    specs = (P("ep"), P(), P("ep"), P("ep"))

    def local(lhs, rhs, g, sizes):
        out, pullback = jax.vjp(lambda a, b: jaxmx.ragged_dot(a, b, sizes), lhs, rhs)
        return (out, *pullback(g))

    run = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=specs,
        out_specs=(P("ep"), P("ep"), P()),
    )
    args = (lhs, rhs, g, jnp.asarray(sizes.reshape(-1), jnp.int32))
    args = jax.device_put(args, tuple(jax.sharding.NamedSharding(mesh, s) for s in specs))
    out, dlhs, drhs = jax.jit(run)(*args)
    want = [
        reference_vjp(lhs[40 * d : 40 * (d + 1)], rhs, g[40 * d : 40 * (d + 1)], sizes[d])
        for d in range(8)
    ]
    np.testing.assert_allclose(out, np.concatenate([w[0] for w in want]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dlhs, np.concatenate([w[1] for w in want]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(drhs, sum(w[2] for w in want), rtol=1e-5, atol=1e-5)


def test_matches_lax_ragged_dot_to_mxfp8_accuracy():
    lhs, rhs, g = inputs(1)
    sizes = jnp.asarray(SIZES)
    want_out, pullback = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), lhs, rhs)
    want = (want_out, *pullback(g))
    got = mx_vjp(lhs, rhs, g, SIZES)
    assert np.all(np.asarray(got[0])[int(SIZES.sum()) :] == 0)  # rows past the last group
    for a, b in zip(got, want, strict=True):
        err = np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
        assert 1e-3 < err < 0.08


def test_weight_gradient_blocks_never_mix_groups():
    """One group's tokens scaled by 2^20: every other group's weight gradient is unchanged (a
    block spanning two groups would take its scale from the large group)."""
    lhs, rhs, g = inputs(2)
    start, stop = groups(SIZES)[3]
    scaled = lhs.at[start:stop].multiply(2.0**20)
    base, loud = mx_vjp(lhs, rhs, g, SIZES)[2], mx_vjp(scaled, rhs, g, SIZES)[2]
    for j in (0, 1, 2, 4):
        np.testing.assert_array_equal(base[j], loud[j])
    assert not np.array_equal(base[3], loud[3])


def test_bad_inputs():
    lhs, rhs, _ = inputs()
    sizes = jnp.asarray(SIZES)
    with pytest.raises(NotImplementedError, match="no native grouped MX GEMM"):
        jaxmx.ragged_dot(lhs, rhs, sizes, recipe=jaxmx.recipes.MXFP8.replace(backend="ffi"))
    with pytest.raises(NotImplementedError, match=r"Recipe\.accum_bits .* not available"):
        jaxmx.ragged_dot(lhs, rhs, sizes, recipe=jaxmx.recipes.MXFP8.replace(accum_bits=14))
    with pytest.raises(ValueError, match=r"rhs \[g, k, n\] with the same k"):
        jaxmx.ragged_dot(lhs, rhs[:, :32], sizes)
    with pytest.raises(ValueError, match="group_sizes must be"):
        jaxmx.ragged_dot(lhs, rhs, sizes[:3])
    with pytest.raises(ValueError, match="group_sizes must be"):
        jaxmx.ragged_dot(lhs, rhs, sizes.astype(jnp.float32))


def test_the_docs_moe_layer_trains():
    """The nnx MoE layer of docs/flax.md runs as written and its grouped GEMMs are jaxmx's."""
    import pathlib
    import re

    doc = pathlib.Path(__file__).resolve().parent.parent / "docs" / "flax.md"
    block = next(b for b in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S) if "MoE" in b)
    scope: dict = {}
    exec(compile(block, str(doc), "exec"), scope)
    moe, x, grads = scope["moe"], scope["x"], scope["grads"]
    assert moe.ragged_dot == jaxmx.flax.MXRaggedDot()  # the module holds the hook
    assert np.isfinite(float(scope["loss"]))
    for name in ("w_in", "w_out", "router"):
        leaves = jax.tree.leaves(getattr(grads, name))
        assert leaves and all(np.all(np.isfinite(v)) and np.any(v != 0) for v in leaves)
    assert str(jax.make_jaxpr(lambda x: moe(x))(x)).count("custom_vjp_call") == 2


def saved_residuals(capsys, fn, *args) -> list[tuple[str, str]]:
    """(type, name) of each residual that ``jax.checkpoint``'s remat saves for ``fn``'s backward
    pass, from ``jax.ad_checkpoint.print_saved_residuals`` (name '' when unnamed)."""
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
    out = []
    for line in capsys.readouterr().out.splitlines():
        name = line.split("named '")[1].split("'")[0] if "named '" in line else ""
        out.append((line.split()[0], name))
    return out


@pytest.mark.parametrize(
    "residuals, names, dtypes",
    [
        ("quantized", QUANTIZED_NAMES, ("u8",)),  # the codes and scales as bits
        ("high_precision", INPUT_NAMES, ("f32",)),
    ],
)
def test_residuals_follow_the_recipe_and_are_named_for_remat(capsys, residuals, names, dtypes):
    """Failed before: ragged_dot saved unnamed 8-bit copies whatever Recipe.residuals said."""
    lhs, rhs, _ = inputs()
    sizes = jnp.asarray(SIZES)
    recipe = jaxmx.recipes.MXFP8.replace(residuals=residuals)
    loss = lambda a, b: jnp.sum(jaxmx.ragged_dot(a, b, sizes, recipe=recipe) ** 2)
    policy = jax.checkpoint_policies.save_only_these_names(*names)
    saved = saved_residuals(capsys, jax.checkpoint(loss, policy=policy), lhs, rhs)
    named = [(t, n) for t, n in saved if n]
    assert {n for _, n in named} == set(names)
    assert all(t.split("[")[0] in dtypes for t, _ in named), named
    _, pullback = jax.vjp(lambda a, b: jaxmx.ragged_dot(a, b, sizes, recipe=recipe), lhs, rhs)
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(pullback)) - sizes.nbytes
    padded_rows = -(-(M + 31 * len(SIZES)) // 32) * 32  # lhs laid out by group
    if residuals == "quantized":  # fp8 codes + one E8M0 byte per 32, N padded to whole blocks
        elements = padded_rows * K + len(SIZES) * K * -(-N // 32) * 32
        assert nbytes == elements + elements // 32
    else:
        assert nbytes == lhs.nbytes + rhs.nbytes


@pytest.mark.parametrize(
    "policy",
    [
        jax.checkpoint_policies.save_only_these_names(*QUANTIZED_NAMES),
        jax.checkpoint_policies.nothing_saveable,
        jax.checkpoint_policies.everything_saveable,
    ],
)
def test_remat_and_residuals_leave_the_gradients_unchanged(policy):
    """Quantization is deterministic (round to nearest): the backward GEMMs read the same codes
    whether they were saved, recomputed, or quantized from saved inputs."""
    lhs, rhs, _ = inputs(3)
    sizes = jnp.asarray(SIZES)

    def loss(recipe):
        return lambda a, b: jnp.sum(jnp.sin(jaxmx.ragged_dot(a, b, sizes, recipe=recipe)))

    quantized = jaxmx.recipes.MXFP8
    want = jax.jit(jax.grad(loss(quantized), (0, 1)))(lhs, rhs)
    high = jax.jit(jax.grad(loss(quantized.replace(residuals="high_precision")), (0, 1)))
    remat = jax.jit(jax.grad(jax.checkpoint(loss(quantized), policy=policy), (0, 1)))
    for got in (high(lhs, rhs), remat(lhs, rhs)):
        jax.tree.map(np.testing.assert_array_equal, got, want)


def test_telemetry_records_its_four_legs():
    """Failed before: ragged_dot reported nothing to telemetry. Legs against the numpy block
    statistics of the operands each GEMM quantizes (the wgrad one laid out by group)."""
    from test_telemetry import reference_leg

    lhs, rhs, g = inputs(4)
    sizes = jnp.asarray(SIZES)

    def loss(rhs, taps):
        with diagnostics.telemetry(taps) as record, diagnostics.named("experts"):
            y = jaxmx.ragged_dot(lhs, rhs, sizes)
        return jnp.sum(y * g), record.forward

    taps = diagnostics.gemm_taps(loss, rhs)
    step = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
    (_, forward), (_, tap_grads) = step(rhs, taps)
    with diagnostics.telemetry() as unnamed:
        jaxmx.ragged_dot(lhs, rhs, sizes)
    assert list(unnamed.forward) == ["ragged_dot"]
    report = diagnostics.telemetry_report(forward, tap_grads)
    assert list(report) == ["experts"]
    legs = report["experts"]
    g_np = np.asarray(g)
    by_group = np.zeros((-(-(M + 31 * len(SIZES)) // 32) * 32, N), np.float32)
    start = 0
    for a, b in groups(SIZES):  # each group's rows from a multiple of 32
        by_group[start : start + b - a] = g_np[a:b]
        start += -(-(b - a) // 32) * 32
    for leg, x, axis in (
        (legs.lhs, lhs, 1),
        (legs.rhs, rhs, 1),
        (legs.dgrad, g, 1),
        (legs.wgrad, by_group, 0),
    ):
        want = reference_leg(np.asarray(x), "mxfp8_e4m3", axis)
        for field in diagnostics.LegStats._fields:
            np.testing.assert_allclose(getattr(leg, field), want[field], rtol=1e-5, err_msg=field)


# --- every preset, adapted by jaxmx.grouped_recipe ---------------------------------------------

PRESETS = [  # per-tensor and per-row presets have no grouped form (tests/test_tensor_row_fp8.py)
    name
    for name in jaxmx.recipes.__all__
    if name != "Recipe" and jaxmx.FORMATS[getattr(jaxmx.recipes, name).fwd].span == "block"
]
MOE_SIZES = np.array([40, 0, 20])  # m = 64: one empty group, 4 rows past the last group
MOE_M, MOE_K, MOE_N = 64, 64, 32
# relative Frobenius error to lax.ragged_dot's forward and gradients, per element format (about
# 0.04 measured for E4M3, 0.06 for E5M2 gradients, 0.15 to 0.21 for the 4-bit presets)
TOLERANCE = {
    "mxfp8_e4m3": 0.05,
    "mxfp8_e5m2": 0.08,
    "fp8_e4m3_block": 0.05,
    "mxfp4": 0.3,
    "nvfp4": 0.25,
}


def moe_inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(keys[0], (MOE_M, MOE_K))
    rhs = jax.random.normal(keys[1], (len(MOE_SIZES), MOE_K, MOE_N)) * MOE_K**-0.5
    g = jax.random.normal(keys[2], (MOE_M, MOE_N))
    return lhs, rhs, g


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_trains_through_ragged_dot(name):
    """Failed before: weight tiles, then the Hadamard transform, were refused."""
    recipe = getattr(jaxmx.recipes, name)
    lhs, rhs, g = moe_inputs()
    sizes = jnp.asarray(MOE_SIZES)
    key = jax.random.key(5)
    want_out, pullback = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), lhs, rhs)
    want = (want_out, *pullback(g))
    got = mx_vjp(lhs, rhs, g, MOE_SIZES, recipe, key)
    tol = max(TOLERANCE[recipe.fwd], TOLERANCE[recipe.grad])
    for what, a, b in zip(("out", "dlhs", "drhs"), got, want, strict=True):
        err = np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
        assert 1e-3 < err < tol, (what, err)  # quantized, to the format's accuracy
    assert np.all(np.asarray(got[0])[int(MOE_SIZES.sum()) :] == 0)  # rows past the last group
    assert np.all(np.asarray(got[2])[1] == 0)  # the empty group's weight gradient


def test_grouped_recipe_changes_only_the_backend():
    """Weight tiles cover one expert's [k, n] matrix and the Hadamard transform runs within each
    group's whole blocks, so both hold exactly; only the backend changes (emulation)."""
    for name in PRESETS:
        recipe = getattr(jaxmx.recipes, name)
        assert jaxmx.grouped_recipe(recipe) == recipe.replace(backend="emulate"), name
    assert jaxmx.grouped_recipe(jaxmx.recipes.NVFP4).weight_tile == (16, 16)
    with pytest.raises(NotImplementedError, match=r"Recipe\.accum_bits .* not available"):
        jaxmx.grouped_recipe(jaxmx.recipes.MXFP8.replace(accum_bits=14))
    with pytest.raises(NotImplementedError, match="no native grouped MX GEMM"):
        jaxmx.grouped_recipe(jaxmx.recipes.MXFP8.replace(backend="ffi"))
    with pytest.raises(TypeError, match=r"must be a jaxmx\.Recipe"):
        jaxmx.grouped_recipe("mxfp8")


def qdq_tiled(w, fmt, tile=32):
    """w [k, n] quantized in ``tile x tile`` tiles (one E8M0 scale each, rceil) and decoded."""
    w = np.asarray(w, np.float64)
    out = np.zeros_like(w)
    for i in range(0, w.shape[0], tile):
        for j in range(0, w.shape[1], tile):
            t = w[i : i + tile, j : j + tile]
            e = ref.scale_byte(np.float32(np.abs(t).max()), fmt, "rceil") - 127
            out[i : i + tile, j : j + tile] = ref.round_to_grid(t * 2.0**-e, fmt) * 2.0**e
    return out


def hadamard_per_group(x, signs):
    """x [rows, c] (rows a multiple of 16): each 16-row block times H16 diag(signs) / 4."""
    h = np.array([[1.0]])
    while h.shape[0] < 16:
        h = np.kron(h, np.array([[1.0, 1.0], [1.0, -1.0]]))
    t = h * signs[None, :] / 4.0
    blocks = np.asarray(x, np.float64).reshape(-1, 16, x.shape[1])
    return np.einsum("ij,bjc->bic", t, blocks).reshape(x.shape)


def rows_mxfp4(x, axis):
    """x quantized to MXFP4 (rceil) along ``axis`` and decoded, by tests/reference.py."""
    x = np.asarray(x, np.float32)
    data, scale = ref.quantize(x, "mxfp4", "rceil", axis=axis)
    return ref.dequantize(data, scale, axis, x.shape)


def rows_nvfp4(x, axis):
    """x quantized to NVFP4 along ``axis`` (one tensor scale for all of x) and decoded."""
    x = np.asarray(x, np.float32)
    return ref.nvfp4(x, axis=axis)[3][tuple(slice(0, n) for n in x.shape)]


# preset -> (rows quantizer, the tiled weight [g, k, n] decoded, the block along the tokens)
DEFINITIONS = {
    "MXFP4": (rows_mxfp4, lambda w: np.stack([qdq_tiled(e, "mxfp4") for e in w]), 32),
    "NVFP4": (rows_nvfp4, lambda w: ref.nvfp4(np.asarray(w), tile=(16, 16))[3], 16),
}


@pytest.mark.parametrize("name", DEFINITIONS)
def test_tiles_and_hadamard_transform_are_the_definition(name):
    """The 4-bit presets (rounding to nearest, so deterministic) against numpy: the forward and
    dgrad on each expert's tiled weight (NVFP4: one tensor scale over all experts); the wgrad on
    the tokens laid out by group (each group from a multiple of the block, zero-padded), Hadamard-
    transformed in 16-row blocks (the sign vector of jaxmx.rht's definition), then quantized
    along the tokens (NVFP4: one tensor scale over the whole layout)."""
    rows_q, tiled_q, block = DEFINITIONS[name]
    recipe = getattr(jaxmx.recipes, name).replace(grad_rounding="nearest")
    lhs, rhs, g = moe_inputs(1)
    got = mx_vjp(lhs, rhs, g, MOE_SIZES, recipe)
    signs = np.asarray(jax.random.rademacher(jax.random.key(recipe.rht_seed), (16,), jnp.float32))
    padded = -(-MOE_SIZES // block) * block
    starts = np.cumsum(padded) - padded
    layout_rows = -(-(MOE_M + (block - 1) * len(MOE_SIZES)) // block) * block

    def by_group(x):  # [m, c] -> [layout_rows, c], Hadamard-transformed
        out = np.zeros((layout_rows, x.shape[1]))
        for start, (a, b) in zip(starts, groups(MOE_SIZES), strict=True):
            out[start : start + b - a] = x[a:b]
        return rows_q(hadamard_per_group(out, signs).astype(np.float32), 0)

    w = tiled_q(rhs)
    lq, gq = rows_q(lhs, 1), rows_q(g, 1)
    xt, gt = by_group(np.asarray(lhs)), by_group(np.asarray(g))
    out, dlhs = np.zeros((MOE_M, MOE_N)), np.zeros((MOE_M, MOE_K))
    drhs = np.zeros((len(MOE_SIZES), MOE_K, MOE_N))
    for j, (a, b) in enumerate(groups(MOE_SIZES)):
        out[a:b], dlhs[a:b] = lq[a:b] @ w[j], gq[a:b] @ w[j].T
        rows = slice(starts[j], starts[j] + padded[j])
        drhs[j] = xt[rows].T @ gt[rows]
    for what, a, b in zip(("out", "dlhs", "drhs"), got, (out, dlhs, drhs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=what)


def test_vmap_matches_the_grouped_product_per_example():
    """Failed before: lax.ragged_dot batches only when all three operands are mapped along axis 0
    (JAX raised 'ragged_dot vmap over any dim but 0 - NYI'). Small integers are exact in MXFP8,
    so the result is the exact grouped product (numpy, per example)."""
    keys = jax.random.split(jax.random.key(6), 2)
    lhs = jax.random.randint(keys[0], (3, 8, 32), -4, 5).astype(jnp.float32)
    rhs = jax.random.randint(keys[1], (2, 32, 4), -4, 5).astype(jnp.float32)
    sizes = np.array([[2, 6], [0, 5], [8, 0]])
    out = jax.jit(jax.vmap(lambda a, s: jaxmx.ragged_dot(a, rhs, s)))(lhs, sizes)
    loss = lambda a, s: jaxmx.ragged_dot(a, rhs, s).sum()
    dlhs = jax.jit(jax.vmap(jax.grad(loss)))(lhs, sizes)
    lhs_np, rhs_np = np.asarray(lhs), np.asarray(rhs)
    for i, example in enumerate(sizes):
        want_out, want_dlhs = np.zeros((8, 4)), np.zeros((8, 32))
        for j, (a, b) in enumerate(groups(example)):
            want_out[a:b] = lhs_np[i, a:b] @ rhs_np[j]
            want_dlhs[a:b] = rhs_np[j].sum(axis=1)
        np.testing.assert_array_equal(out[i], want_out)
        np.testing.assert_array_equal(dlhs[i], want_dlhs)
