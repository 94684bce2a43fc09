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
    out, dlhs = np.zeros((M, N)), np.zeros((M, K))
    drhs = np.zeros((len(sizes), K, N))
    lq, gq = qdq(lhs, 1), qdq(g, 1)
    for j, (a, b) in enumerate(groups(sizes)):
        out[a:b] = lq[a:b] @ qdq(rhs[j], 0)
        dlhs[a:b] = gq[a:b] @ qdq(rhs[j], 1).T
        if b > a:
            drhs[j] = qdq(lhs[a:b], 0).T @ qdq(g[a:b], 0)
    return out, dlhs, drhs


def mx_vjp(lhs, rhs, g, sizes, recipe=jaxmx.recipes.MXFP8):
    @jax.jit
    def run(lhs, rhs, g, sizes):  # group sizes traced
        f = lambda a, b: jaxmx.ragged_dot(a, b, sizes, recipe=recipe)
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
    with pytest.raises(NotImplementedError, match=r"Recipe\.rht .* not available"):
        jaxmx.ragged_dot(lhs, rhs, sizes, recipe=jaxmx.recipes.MXFP8.replace(rht=True))
    with pytest.raises(NotImplementedError, match=r"Recipe\.weight_tile .* not available"):
        jaxmx.ragged_dot(lhs, rhs, sizes, recipe=jaxmx.recipes.MXFP8_2D)
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
        ("quantized", QUANTIZED_NAMES, ("f8_e4m3fn", "f8_e8m0fnu")),
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
