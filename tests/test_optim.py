"""jaxmx.optim: Adam with low-precision moments, against numpy references of each storage scheme.

The references here are written from the scheme's definition (docs/optimizers.md): blocks of
consecutive row-major elements, a float32 absmax scale per block (``absmax / 448`` for FP8), the
nearest code-map value (ties to the larger), FP8 through ml_dtypes; 4-bit codes two per byte, the
first of a pair in the high nibble. tests/interop/test_torchao_optim.py checks the same schemes
against torchao's own optimizers.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmx
import jaxmx.optim
from jaxmx._src.optim import moments

FORMATS = ("float32", "bfloat16", "8bit", "fp8", "4bit")
BLOCK_FORMATS = ("8bit", "fp8", "4bit")
BLOCKS = {"8bit": 256, "fp8": 256, "4bit": 128}
MAPS = {
    ("8bit", True): jaxmx.optim.DYNAMIC_8BIT_SIGNED,
    ("8bit", False): jaxmx.optim.DYNAMIC_8BIT_UNSIGNED,
    ("4bit", True): jaxmx.optim.DYNAMIC_4BIT_SIGNED,
    ("4bit", False): jaxmx.optim.LINEAR_4BIT_UNSIGNED,
}
# a small model's parameters: two block layouts (last axis, and the whole [512, 128] weight),
# and three kept in float32 (below min_size; a multiple of no block)
SHAPES = {"up": (32, 512), "down": (512, 128), "bias": (512,), "norm": (64,), "odd": (5, 7)}


def params_of(shapes=SHAPES, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {n: jax.random.normal(k, s) for (n, s), k in zip(shapes.items(), keys, strict=True)}


def grads_of(step, shapes=SHAPES):
    return params_of(shapes, seed=100 + step)


def named(stored: tuple, name: str):
    """The stored moment of parameter ``name`` (a key of a dict of parameters)."""
    (m,) = [m for m in stored if m.name == f"['{name}']"]
    return m


def nearest_codes(y: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest table value (float64 distances), the larger one at a tie."""
    dist = np.abs(y[..., None].astype(np.float64) - table.astype(np.float64))
    return (table.size - 1 - np.argmin(dist[..., ::-1], axis=-1)).astype(np.uint8)


def reference_encode(x: np.ndarray, fmt: str, signed: bool):
    """(codes, scales) of the scheme, flat blocks in row-major order; 4-bit codes packed."""
    block = BLOCKS[fmt]
    flat = np.asarray(x, np.float32).reshape(-1, block)
    absmax = np.maximum(np.abs(flat).max(-1), np.float32(1e-12))
    if fmt == "fp8":
        scales = (absmax / np.float32(448)).astype(np.float32)
        codes = (flat / scales[:, None]).astype(ml_dtypes.float8_e4m3fn).reshape(-1)
        return codes, scales
    codes = nearest_codes(flat / absmax[:, None], MAPS[fmt, signed]).reshape(-1)
    if fmt == "4bit":
        codes = (codes[0::2] << 4) | codes[1::2]
    return codes, absmax


def reference_decode(codes, scales, fmt, signed) -> np.ndarray:
    codes, scales = np.asarray(codes).reshape(-1), np.asarray(scales, np.float64).reshape(-1)
    if fmt == "fp8":
        values = codes.astype(np.float64)
    else:
        if fmt == "4bit":
            codes = np.stack([codes >> 4, codes & 15], -1).reshape(-1)
        values = MAPS[fmt, signed].astype(np.float64)[codes]
    return (values.reshape(scales.size, -1) * scales[:, None]).reshape(-1)


def error_bound(fmt: str, signed: bool, scales: np.ndarray, shape) -> np.ndarray:
    """Per element, the most a stored moment may differ from its float32 value: half the widest
    gap of the code map times the block scale; FP8 E4M3: half an ulp (2^-4 relative, at least
    2^-10 times the scale, the subnormal half step)."""
    block = BLOCKS[fmt]
    per_block = np.asarray(scales, np.float64).reshape(-1)
    if fmt == "fp8":
        return np.repeat(per_block * 2.0**-10, block).reshape(shape), 2.0**-4
    gaps = np.diff(MAPS[fmt, signed].astype(np.float64))
    half = gaps.max() / 2
    if not signed and fmt == "4bit":  # no zero in the map: values below 1/16 round up to it
        half = max(half, 1 / 16)
    return np.repeat(per_block * half * (1 + 2.0**-20), block).reshape(shape), 0.0


# -- code maps ---------------------------------------------------------------------------------


def test_code_maps_are_sorted_tables_of_the_right_size_and_range():
    for (fmt, signed), table in MAPS.items():
        assert table.dtype == np.float32 and table.size == (256 if fmt == "8bit" else 16)
        assert np.all(np.diff(table) > 0) and table[-1] == 1.0
        assert table[0] < -0.8 if signed else table[0] >= 0
    np.testing.assert_array_equal(jaxmx.optim.LINEAR_4BIT_UNSIGNED, np.arange(1, 17) / 16)
    assert 0.0 in jaxmx.optim.DYNAMIC_8BIT_SIGNED and 0.0 in jaxmx.optim.DYNAMIC_8BIT_UNSIGNED


def test_quantize_to_map_is_the_nearest_value_and_ties_go_up():
    from jaxmx._src.optim.code_maps import quantize_to_map

    y = np.random.default_rng(0).uniform(-1.0, 1.0, 4096).astype(np.float32)
    for (_, signed), table in MAPS.items():
        x = y if signed else np.abs(y)
        np.testing.assert_array_equal(
            quantize_to_map(jnp.asarray(x), table), nearest_codes(x, table)
        )
    midpoints = (2 * np.arange(1, 16) + 1) / 32  # exact midpoints of the k / 16 map
    got = quantize_to_map(jnp.asarray(midpoints, jnp.float32), jaxmx.optim.LINEAR_4BIT_UNSIGNED)
    np.testing.assert_array_equal(got, np.arange(1, 16))


# -- storage of one moment ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape", [(8, 512), (512, 128), (4, 2, 96)])
def test_encode_matches_the_reference_scheme_bit_for_bit(fmt, signed, shape):
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    x[0] = 0.0  # a zero block (or a zero row inside one)
    x = x if signed else x * x
    like = moments.zeros(jnp.zeros(shape), fmt, signed=signed, block=BLOCKS[fmt], min_size=1)
    stored = jax.jit(moments.encode)(jnp.asarray(x), like)  # fused as inside an update
    codes, scales = reference_encode(x, fmt, signed)
    got = np.asarray(stored.codes).reshape(-1)
    np.testing.assert_array_equal(got.view(np.uint8), codes.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(stored.scales).reshape(-1), scales)
    decoded = np.asarray(moments.decode(stored)).reshape(-1)
    np.testing.assert_allclose(decoded, reference_decode(codes, scales, fmt, signed), rtol=1e-7)


def test_block_layout_keeps_the_trailing_axes_and_packs_4bit_codes():
    assert moments.block_axis((32, 512), 256) == 1
    assert moments.block_axis((512, 128), 256) == 0
    assert moments.block_axis((4, 2, 96), 256) == 0
    assert moments.block_axis((4, 2, 64), 128) == 1
    m = moments.zeros(jnp.zeros((4, 2, 64)), "4bit", signed=True, block=128, min_size=1)
    assert (m.codes.shape, m.scales.shape, m.axis) == ((4, 64), (4, 1), 1)


# -- the transform -----------------------------------------------------------------------------


def float32_adam_bytes(params):
    return jaxmx.optim.state_bytes(optax.adam(1e-3).init(params))


@pytest.mark.parametrize(
    "fmt, ratio", [("bfloat16", 0.5), ("8bit", 0.27), ("fp8", 0.27), ("4bit", 0.15)]
)
def test_state_bytes_against_float32_adam(fmt, ratio):
    # mostly large matrices, as a model's are; the small ones stay float32 and count too
    shapes = {"a": (256, 1024), "b": (1024, 256), "e": (512, 256), "bias": (1024,)}
    params = params_of(shapes)
    state = jaxmx.optim.adam(1e-3, state_format=fmt).init(params)
    got = jaxmx.optim.state_bytes(state) / float32_adam_bytes(params)
    assert got <= ratio + 1e-6, got
    report = jaxmx.optim.state_report(state)
    assert report.total_bytes == jaxmx.optim.state_bytes(state)
    on_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
    assert on_device == report.total_bytes


@pytest.fixture(scope="module")
def runs():
    """Three jitted steps of adamw in every format, from the same params and gradients: the
    states before each step, the directions and the states after."""
    params = params_of()
    out = {}
    for fmt in FORMATS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tx = jaxmx.optim.scale_by_adam(0.9, 0.99, 1e-8, state_format=fmt)
            state = tx.init(params)
        update = jax.jit(tx.update)
        steps = []
        for t in range(1, 4):
            direction, new = update(grads_of(t), state, params)
            steps.append((state, direction, new))
            state = new
        out[fmt] = steps
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_direction_matches_a_float64_adam_step_on_the_stored_moments(runs, fmt):
    for t, (before, direction, after) in enumerate(runs[fmt], start=1):
        for name in SHAPES:
            g = np.asarray(grads_of(t)[name], np.float64)
            m0 = np.asarray(moments.decode(named(before.mu, name)), np.float64)
            v0 = np.asarray(moments.decode(named(before.nu, name)), np.float64)
            w1, w2 = float(np.float32(0.1)), float(np.float32(0.01))  # 1 - b as float32
            m = m0 + w1 * (g - m0)
            v = v0 + w2 * (g * g - v0)
            # the float32 rounding of each lerp (a difference, a product, a sum)
            m_err = 2.0**-22 * (np.abs(m0) + np.abs(g))
            v_err = 2.0**-22 * (np.abs(v0) + g * g)
            denom = np.sqrt(v) / np.sqrt(1 - 0.99**t) + 1e-8
            ref = (m / (1 - 0.9**t)) / denom
            # float32 rounding of the direction's ~8 operations, and of m and v
            atol = m_err / (1 - 0.9**t) / denom + np.abs(ref) * v_err / np.maximum(v, 1e-30)
            bound = 2e-6 * np.abs(ref) + atol + 1e-30
            assert np.all(np.abs(np.asarray(direction[name]) - ref) <= bound), (fmt, t, name)
            for key, value, err, signed in (("mu", m, m_err, True), ("nu", v, v_err, False)):
                stored = named(getattr(after, key), name)
                got = np.asarray(moments.decode(stored), np.float64)
                if isinstance(stored, jaxmx.optim.DenseMoment):
                    rel = 2.0**-8 if stored.format == "bfloat16" else 0.0  # 7 fraction bits
                    assert np.all(np.abs(got - value) <= rel * np.abs(value) + 1.01 * err)
                    continue
                absolute, relative = error_bound(fmt, signed, stored.scales, value.shape)
                assert np.all(np.abs(got - value) <= absolute + relative * np.abs(value) + err)


def test_first_step_of_the_float32_format_is_optax_adam():
    params = params_of()
    ours = jaxmx.optim.adam(1e-2, state_format="float32")
    theirs = optax.adam(1e-2)
    u, _ = ours.update(grads_of(1), ours.init(params), params)
    v, _ = theirs.update(grads_of(1), theirs.init(params), params)
    for name in SHAPES:
        np.testing.assert_allclose(u[name], v[name], rtol=1e-6)


def test_small_and_indivisible_parameters_are_reported():
    with pytest.warns(UserWarning, match=r"\['big_odd'\] .*stays float32"):
        state = jaxmx.optim.adamw(1e-3, state_format="8bit").init(
            {"w": jnp.ones((16, 512)), "b": jnp.ones(512), "big_odd": jnp.ones((65, 65))}
        )
    report = jaxmx.optim.state_report(state)
    fallbacks = {(r.path, r.moment): r.note for r in report.fallbacks}
    assert fallbacks == {
        ("['b']", "mu"): "512 elements, below min_size=4096",
        ("['b']", "nu"): "512 elements, below min_size=4096",
        ("['big_odd']", "mu"): "4225 elements, not a multiple of the block (256)",
        ("['big_odd']", "nu"): "4225 elements, not a multiple of the block (256)",
    }
    assert "below min_size" in str(report) and "8bit" in str(report)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match=r"unknown moment format 'int8' \(state_format\)"):
        jaxmx.optim.adam(1e-3, state_format="int8")
    with pytest.raises(ValueError, match=r"'fp4' \(nu_format\)"):
        jaxmx.optim.adam(1e-3, nu_format="fp4")
    with pytest.raises(ValueError, match="block_size"):
        jaxmx.optim.adam(1e-3, block_size=255)


def test_per_moment_formats():
    state = jaxmx.optim.scale_by_adam(mu_format="8bit", nu_format="bfloat16").init(
        {"w": jnp.ones((16, 512))}
    )
    assert state.mu[0].format == "8bit" and state.nu[0].values.dtype == jnp.bfloat16


# -- checkpoints and composition ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", (*BLOCK_FORMATS, "bfloat16"))
def test_orbax_round_trip_bit_for_bit(runs, fmt, tmp_path):
    state = runs[fmt][-1][2]
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_chain_multisteps_and_a_schedule():
    params = params_of()
    schedule = optax.linear_schedule(1e-2, 1e-3, 10)
    inner = optax.chain(
        optax.clip_by_global_norm(1.0), jaxmx.optim.adamw(schedule, state_format="4bit")
    )
    tx = optax.MultiSteps(inner, every_k_schedule=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state, plain = tx.init(params), inner.init(params)
    update = jax.jit(tx.update)
    u1, state = update(grads_of(1), state, params)
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(u1))  # accumulating
    u2, state = update(grads_of(1), state, params)  # the same gradient: its mean is exact
    expected, _ = jax.jit(inner.update)(grads_of(1), plain, params)
    for name in SHAPES:
        np.testing.assert_allclose(u2[name], expected[name], rtol=1e-6, atol=1e-12)
    assert [r.format for r in jaxmx.optim.state_report(state).rows].count("4bit") == 4


def test_nnx_optimizer():
    model = nnx.Linear(128, 512, rngs=nnx.Rngs(0))
    tx = jaxmx.optim.adamw(1e-2, state_format="8bit")
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    before = {"kernel": model.kernel[...], "bias": model.bias[...]}
    x = jax.random.normal(jax.random.key(1), (8, 128))

    @nnx.jit
    def step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return grads

    grads = step(model, optimizer, x)
    grads = {"kernel": grads["kernel"][...], "bias": grads["bias"][...]}
    updates, _ = tx.update(grads, tx.init(before), before)
    expected = optax.apply_updates(before, updates)
    # the same float32 step, compiled apart: a few roundings of p - lr (direction + wd p)
    bound = 2.0**-21 * (np.abs(before["kernel"]) + 1e-2)
    assert np.all(np.abs(model.kernel[...] - expected["kernel"]) <= bound)
    step(model, optimizer, x)  # a second step reads the state nnx kept
    assert int(optimizer.opt_state[0].count) == 2 and np.isfinite(model.kernel[...]).all()
    rows = jaxmx.optim.state_report(optimizer.opt_state).rows
    assert {(r.path, r.format) for r in rows} == {("['bias']", "float32"), ("['kernel']", "8bit")}


def test_bf16_master_weights_round_stochastically_and_without_bias():
    n = 20000
    params = {"w": jnp.ones(n, jnp.bfloat16), "f": jnp.ones(4, jnp.float32)}
    tx = jaxmx.optim.bf16_stochastic_round(0)
    delta = 3 * 2.0**-10  # 3/8 of the bfloat16 step (2^-7) above 1
    updates = {"w": jnp.full(n, delta), "f": jnp.full(4, delta)}
    u, _ = tx.update(updates, tx.init(params), params)
    new = np.asarray(optax.apply_updates(params, u)["w"], np.float64)
    assert set(np.unique(new)) <= {1.0, 1.0 + 2.0**-7}
    p = 3 / 8
    assert abs((new > 1).mean() - p) <= 5 * math.sqrt(p * (1 - p) / n)
    assert u["f"] is updates["f"]
    plain = optax.apply_updates(params, updates)["w"]
    assert np.all(np.asarray(plain, np.float64) == 1.0)  # round to nearest loses the update


# -- sharding ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


SHARDED = {
    "rows": ((64, 512), P("x", None)),
    "cols": ((16, 2048), P(None, "x")),
    "whole": ((512, 128), P("x", None)),
    "small": ((64,), P("x")),
}


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_moments_are_sharded_like_their_parameters(mesh, fmt):
    params = {
        n: jax.device_put(p, NamedSharding(mesh, spec))
        for (n, (_, spec)), p in zip(
            SHARDED.items(),
            params_of({n: s for n, (s, _) in SHARDED.items()}).values(),
            strict=True,
        )
    }
    tx = jaxmx.optim.scale_by_adam(state_format=fmt)
    state = tx.init(params)
    for name, (_, spec) in SHARDED.items():
        m = named(state.mu, name)
        if name == "small":
            assert m.values.sharding.spec == spec
            continue
        # [512, 128]: blocks of 256 run over both axes, blocks of 128 along the last
        whole = P("x") if fmt == "8bit" else P("x", None)
        scale_spec = {"rows": P("x", None), "cols": P(None, "x"), "whole": whole}[name]
        assert m.scales.sharding.spec == scale_spec
        codes_spec = spec if fmt == "8bit" else m.scales.sharding.spec
        assert m.codes.sharding.spec == codes_spec
    grads = jax.tree.map(lambda p: p * 0.5 + 1.0, params)
    direction, new = jax.jit(tx.update)(grads, state, params)
    local = jax.device_put(jax.tree.map(np.asarray, (grads, state)), jax.devices()[0])
    ref_direction, ref_new = jax.jit(tx.update)(*local)
    # the stored moments bit for bit; the direction to float32 rounding (its divisions by the
    # bias corrections may compile differently)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new), strict=True):
        a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    for name in SHARDED:
        np.testing.assert_allclose(direction[name], ref_direction[name], rtol=2.0**-21)
    for old, fresh in zip(jax.tree.leaves(state), jax.tree.leaves(new), strict=True):
        if old.ndim:  # the step count is a scalar
            assert fresh.sharding.is_equivalent_to(old.sharding, old.ndim)


def test_a_sharding_that_splits_blocks_names_the_parameter_and_the_fix(mesh):
    bad = jax.device_put(jnp.ones((48, 96)), NamedSharding(mesh, P("x", None)))
    with pytest.raises(
        jaxmx.BlockShardingError, match=r"\['bad'\] \(shape \(48, 96\).*Shard another"
    ):
        jaxmx.optim.adamw(1e-3, state_format="8bit").init({"bad": bad})
    # bfloat16 moments have no blocks
    jaxmx.optim.adamw(1e-3, state_format="bfloat16").init({"bad": bad})
