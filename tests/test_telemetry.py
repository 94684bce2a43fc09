"""In-training telemetry: per-leg statistics, gradient taps, the NaN localiser, zero cost off."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_diagnostics import adversarial, reference_stats

import jaxmx
import jaxmx.flax.linen as mxl
import jaxmx.flax.nnx as mxnnx
from jaxmx import diagnostics
from jaxmx._src.training import scope

DIMS = (((1,), (0,)), ((), ()))  # x [M, K] @ w [K, N]


def reference_leg(x: np.ndarray, fmt: str, axis: int) -> dict:
    """LegStats from the per-block numpy reference, finite blocks only."""
    r = reference_stats(x, fmt, axis, "rceil")
    finite = np.isfinite(r["amax"])
    span, under = r["span"][finite], r["under"][finite]
    return {
        "span_ratio_max": span.max(),
        "span_ratio_p99": np.percentile(span, 99, method="nearest"),
        "underflow_blocks": np.mean(under > 0),
        "underflow_mean": under.mean(),
        "underflow_max": under.max(),
        "flushed_mean": r["flushed"][finite].mean(),
        "flushed_max": r["flushed"][finite].max(),
        "saturated_max": r["sat"][finite].max(),
        "sqnr_db_min": r["sqnr"][finite].min(),
        "nonfinite": float(not finite.all()),
    }


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4"])
@pytest.mark.parametrize("axis", [1, 0])
def test_leg_stats_equal_the_reference(fmt, axis):
    x = adversarial()
    got = diagnostics.leg_stats(jnp.asarray(x), fmt, axis, "rceil")
    want = reference_leg(x, fmt, axis)
    for field in diagnostics.LegStats._fields:
        np.testing.assert_allclose(getattr(got, field), want[field], rtol=1e-5, err_msg=field)


def three_layers(params, x, taps, inject=lambda h: h):
    """x -> layer0 -> inject -> layer1 -> layer2, each a jaxmx GEMM named by its layer."""
    with diagnostics.telemetry(taps) as record:
        h = x
        for i, w in enumerate(params):
            with diagnostics.named(f"layer{i}"):
                h = jaxmx.dot_general(h, w, DIMS)
            if i == 0:
                h = inject(h)
            h = jnp.tanh(h)
    return jnp.sum(h**2), record.forward


def run_step(params, x, inject=lambda h: h):
    taps = diagnostics.gemm_taps(three_layers, params, x)
    step = jax.jit(jax.value_and_grad(three_layers, (0, 2), has_aux=True), static_argnums=3)
    (_, forward), (_, tap_grads) = step(params, x, taps, inject)
    return diagnostics.telemetry_report(forward, tap_grads)


def make_params(key=0):
    keys = jax.random.split(jax.random.key(key), 4)
    x = jax.random.normal(keys[0], (64, 128))
    return [jax.random.normal(k, (128, 128)) / 8 for k in keys[1:]], x


def gradient_with(fn):
    """An identity whose backward pass applies ``fn`` to the cotangent."""

    @jax.custom_vjp
    def identity(h):
        return h

    identity.defvjp(lambda h: (h, None), lambda _, g: (fn(g),))
    return identity


def test_nvfp4_legs_and_the_wgrad_copy_after_the_hadamard_transform():
    """With the NVFP4 recipe the legs are NVFP4 block statistics, and the wgrad leg describes
    the copy the GEMM quantizes: the gradient after the recipe's RHT along M."""
    recipe = jaxmx.recipes.NVFP4.replace(grad_rounding="nearest")
    x = jax.random.normal(jax.random.key(1), (48, 64))
    w = jax.random.normal(jax.random.key(2), (64, 32)) / 8
    g = jax.random.normal(jax.random.key(3), (48, 32)).at[5].multiply(300.0)  # an outlier row

    def loss(w, taps):
        with diagnostics.telemetry(taps) as record:
            y = jaxmx.dot_general(x, w, DIMS, recipe=recipe)
        return jnp.sum(y * g), record.forward

    taps = diagnostics.gemm_taps(loss, w)
    step = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
    (_, forward), (_, tap_grads) = step(w, taps)
    legs = diagnostics.telemetry_report(forward, tap_grads)["dot_general"]
    x_stats = diagnostics.block_stats(x, "nvfp4")
    assert float(legs.lhs.underflow_max) == float(np.nanmax(x_stats.underflow))
    rotated = jaxmx.rht(g[None], 1, jax.random.key(recipe.rht_seed))
    for copy, leg in ((rotated, legs.wgrad), (g[None], legs.dgrad)):
        axis = 1 if leg is legs.wgrad else 2
        stats = diagnostics.block_stats(copy, "nvfp4", axis=axis)
        np.testing.assert_allclose(leg.sqnr_db_min, np.nanmin(stats.sqnr_db), rtol=1e-6)
    plain = diagnostics.block_stats(g[None], "nvfp4", axis=1)
    assert float(legs.wgrad.sqnr_db_min) != float(np.nanmin(plain.sqnr_db))


def test_the_report_names_every_gemm_in_program_order():
    params, x = make_params()
    report = run_step(params, x)
    assert list(report) == ["layer0", "layer1", "layer2"]
    assert [t.index for t in report.values()] == [0, 1, 2]
    layer1 = report["layer1"]
    want = reference_leg(np.asarray(params[1]).T, "mxfp8_e4m3", 1)  # w as [N, K] along K
    np.testing.assert_allclose(layer1.rhs.span_ratio_max, want["span_ratio_max"], rtol=1e-5)
    assert all(t.dgrad is not None and t.wgrad is not None for t in report.values())
    assert diagnostics.first_nonfinite(report) is None


def test_an_outlier_in_one_gradient_shows_in_that_gemms_backward_legs_only():
    params, x = make_params()
    clean = run_step(params, x)
    planted = run_step(params, x, gradient_with(lambda g: g.at[3, 5].set(1e4)))
    for name in ("layer1", "layer2"):  # run before layer0 in the backward pass: untouched
        for leg in diagnostics.LEGS:
            np.testing.assert_array_equal(getattr(planted[name], leg), getattr(clean[name], leg))
    for leg in ("lhs", "rhs"):
        np.testing.assert_array_equal(
            getattr(planted["layer0"], leg), getattr(clean["layer0"], leg)
        )
    for leg in ("dgrad", "wgrad"):  # the block holding 1e4: sqrt(32) span, its others underflow
        before, after = getattr(clean["layer0"], leg), getattr(planted["layer0"], leg)
        assert after.span_ratio_max > 5.6 > before.span_ratio_max
        assert after.underflow_max > 0.5 > before.underflow_max
        assert after.flushed_max > 0.1 > before.flushed_max


@pytest.mark.parametrize(
    "plant, where",
    [
        ("weight", ("layer1", "rhs")),
        ("input", ("layer0", "lhs")),
        ("gradient", ("layer0", "dgrad")),
    ],
)
def test_the_localiser_names_the_first_gemm_and_leg_that_saw_a_nan(plant, where):
    params, x = make_params()
    inject = lambda h: h
    if plant == "weight":
        params[1] = params[1].at[7, 9].set(jnp.nan)
    elif plant == "input":
        x = x.at[0, 0].set(jnp.inf)
    else:
        inject = gradient_with(lambda g: g.at[0, 0].set(jnp.nan))
    report = run_step(params, x, inject)
    assert diagnostics.first_nonfinite(report) == where


def test_fsdp_dot_general_reports_the_legs_of_all_devices_together():
    """Inside shard_map over 8 devices, fsdp_dot_general records its four legs as the tensors
    of all devices together: the forward ones equal the numpy reference of the whole x and w,
    and all four equal jaxmx.dot_general's report of the same step on one device."""
    mesh = jax.make_mesh((8,), ("fsdp",))
    dims = (((1,), (1,)), ((), ()))  # x [M, K] . w [N, K]
    x = jax.random.normal(jax.random.key(0), (256, 32))
    w = jax.random.normal(jax.random.key(1), (256, 32)) / 8  # 32 rows (one block) per device

    def one_device(x, w, taps):
        with diagnostics.telemetry(taps) as record, diagnostics.named("layer"):
            y = jaxmx.dot_general(x, w, dims)
        return jnp.sum(jnp.tanh(y)), record.forward

    def local(x, w, taps):
        with diagnostics.telemetry(taps) as record, diagnostics.named("layer"):
            y = jaxmx.fsdp_dot_general(x, w, dims, axis_name="fsdp", gather_axis=0)
        return jax.lax.psum(jnp.sum(jnp.tanh(y)), "fsdp"), record.forward

    sharded = jax.shard_map(
        local, mesh=mesh, in_specs=(P("fsdp"), P("fsdp"), P()), out_specs=(P(), P())
    )

    def report(loss, x, w):
        taps = diagnostics.gemm_taps(loss, x, w)
        step = jax.jit(jax.value_and_grad(loss, (0, 2), has_aux=True))
        (_, forward), (_, tap_grads) = step(x, w, taps)
        return diagnostics.telemetry_report(forward, tap_grads)

    got = report(sharded, *jax.device_put((x, w), NamedSharding(mesh, P("fsdp"))))
    assert list(got) == ["layer"]
    want = report(one_device, x, w)["layer"]
    for leg, tensor in (("lhs", x), ("rhs", w)):
        reference = reference_leg(np.asarray(tensor), "mxfp8_e4m3", 1)
        for field in diagnostics.LegStats._fields:
            value = getattr(getattr(got["layer"], leg), field)
            np.testing.assert_allclose(value, reference[field], rtol=1e-5, err_msg=(leg, field))
    for leg in diagnostics.LEGS:
        np.testing.assert_array_equal(getattr(got["layer"], leg), getattr(want, leg), leg)


def test_dot_general_in_shard_map_reports_the_legs_of_all_devices_together():
    """Data parallelism inside shard_map over 8 devices (x and the output gradient split along
    M, w replicated): jaxmx.dot_general records its four legs as the tensors of all devices
    together, each equal to the numpy reference of the whole tensor."""
    mesh = jax.make_mesh((8,), ("dp",))
    recipe = jaxmx.recipes.MXFP8_HYBRID  # E4M3 forward legs, E5M2 gradient legs
    x = jax.random.normal(jax.random.key(0), (256, 64))  # 32 rows (one block along M) each
    w = jax.random.normal(jax.random.key(1), (64, 96)) / 8
    g = jax.random.normal(jax.random.key(2), (256, 96)).at[7, 3].multiply(1e3)  # dL/dy

    def local(x, w, g, taps):
        with diagnostics.telemetry(taps) as record:
            y = jaxmx.dot_general(x, w, DIMS, recipe=recipe)
        return jax.lax.psum(jnp.sum(y * g), "dp"), record.forward

    sharded = jax.shard_map(
        local, mesh=mesh, in_specs=(P("dp"), P(), P("dp"), P()), out_specs=(P(), P())
    )
    args = jax.device_put((x, w, g), tuple(NamedSharding(mesh, s) for s in (P("dp"), P(), P("dp"))))
    taps = diagnostics.gemm_taps(sharded, *args)
    step = jax.jit(jax.value_and_grad(sharded, (1, 3), has_aux=True))
    (_, forward), (dw, tap_grads) = step(*args, taps)
    report = diagnostics.telemetry_report(forward, tap_grads)
    assert list(report) == ["dot_general"]
    legs = report["dot_general"]
    want = {  # each leg's whole tensor along the axis its copy is quantized along
        "lhs": reference_leg(np.asarray(x), "mxfp8_e4m3", 1),
        "rhs": reference_leg(np.asarray(w), "mxfp8_e4m3", 0),
        "dgrad": reference_leg(np.asarray(g), "mxfp8_e5m2", 1),
        "wgrad": reference_leg(np.asarray(g), "mxfp8_e5m2", 0),
    }
    for leg in diagnostics.LEGS:
        for field in diagnostics.LegStats._fields:
            value = getattr(getattr(legs, leg), field)
            np.testing.assert_allclose(value, want[leg][field], rtol=1e-5, err_msg=(leg, field))
    assert legs.wgrad.span_ratio_max > 5.6  # the outlier's block, on device 0 only
    assert dw.shape == w.shape and np.isfinite(np.asarray(dw)).all()


def test_ragged_dot_in_shard_map_reports_the_legs_of_all_devices_together():
    """jaxmx.ragged_dot inside shard_map over 8 devices, each with its own tokens (two groups
    of 32 rows) and the experts replicated: the legs of all devices together. The wgrad leg
    lays each device's gradient out by group, each group's rows from a multiple of the block,
    padded with zero rows to m + 31 g = 126 -> 128 rows: its blocks are those of g and as many
    all-zero blocks."""
    mesh = jax.make_mesh((8,), ("ep",))
    lhs = jax.random.normal(jax.random.key(0), (512, 64))  # 64 tokens per device
    rhs = jax.random.normal(jax.random.key(1), (2, 64, 32)) / 8
    g = jax.random.normal(jax.random.key(2), (512, 32))
    sizes = jnp.array([32, 32], jnp.int32)

    def local(lhs, rhs, g, taps):
        with diagnostics.telemetry(taps) as record:
            y = jaxmx.ragged_dot(lhs, rhs, sizes)
        return jax.lax.psum(jnp.sum(y * g), "ep"), record.forward

    sharded = jax.shard_map(
        local, mesh=mesh, in_specs=(P("ep"), P(), P("ep"), P()), out_specs=(P(), P())
    )
    specs = (P("ep"), P(), P("ep"))
    args = jax.device_put((lhs, rhs, g), tuple(NamedSharding(mesh, s) for s in specs))
    taps = diagnostics.gemm_taps(sharded, *args)
    step = jax.jit(jax.value_and_grad(sharded, 3, has_aux=True))
    (_, forward), tap_grads = step(*args, taps)
    legs = diagnostics.telemetry_report(forward, tap_grads)["ragged_dot"]
    g = np.asarray(g)
    want = {
        "lhs": reference_leg(np.asarray(lhs), "mxfp8_e4m3", 1),
        "rhs": reference_leg(np.asarray(rhs).transpose(0, 2, 1).reshape(-1, 64), "mxfp8_e4m3", 1),
        "dgrad": reference_leg(g, "mxfp8_e4m3", 1),
        "wgrad": reference_leg(np.concatenate([g, np.zeros_like(g)]), "mxfp8_e4m3", 0),
    }
    for leg in diagnostics.LEGS:
        for field in diagnostics.LegStats._fields:
            value = getattr(getattr(legs, leg), field)
            np.testing.assert_allclose(value, want[leg][field], rtol=1e-5, err_msg=(leg, field))


def test_telemetry_off_compiles_to_the_program_without_the_feature(monkeypatch):
    params, x = make_params()

    def loss(params, x):
        h = x
        for w in params:
            h = jnp.tanh(jaxmx.dot_general(h, w, DIMS))
        return jnp.sum(h**2)

    def hlo():
        return jax.jit(jax.grad(loss)).lower(params, x).as_text()

    with_hook = hlo()
    monkeypatch.setattr(scope, "observe", lambda *_: None)
    assert with_hook == hlo()


def test_forward_only_telemetry_needs_no_taps():
    params, x = make_params()
    _, forward = jax.jit(three_layers)(params, x, None)
    report = diagnostics.telemetry_report(forward)
    assert list(report) == ["layer0", "layer1", "layer2"] and report["layer0"].dgrad is None


def test_flax_layers_are_named_by_module_path():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(64, name="down")(jax.nn.gelu(nn.Dense(128, name="up")(x)))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Block(name="block1")(Block(name="block0")(x))

    model = mxl.quantize_model(Net())
    x = jax.random.normal(jax.random.key(0), (32, 64))
    params = model.init(jax.random.key(1), x)["params"]

    def loss(params, taps):
        with diagnostics.telemetry(taps) as record:
            y = model.apply({"params": params}, x)
        return jnp.mean(y**2), record.forward

    taps = diagnostics.gemm_taps(loss, params)
    (_, fwd), (_, grads) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, taps)
    names = ["block0/up", "block0/down", "block1/up", "block1/down"]
    assert list(diagnostics.telemetry_report(fwd, grads)) == names


def test_nnx_quantize_model_names_its_layers_and_attention_products():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.MultiHeadAttention(2, 64, decode=False, rngs=rngs)
            self.mlp = nnx.Linear(64, 64, rngs=rngs)

        def __call__(self, x):
            return self.mlp(self.attn(x))

    model = Net(nnx.Rngs(0))
    mxnnx.quantize_model(model, attention=True)
    x = jax.random.normal(jax.random.key(0), (2, 32, 64))

    def loss(model, taps):
        with diagnostics.telemetry(taps) as record:
            y = model(x)
        return jnp.mean(y**2), record.forward

    taps = diagnostics.gemm_taps(loss, model)
    step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, fwd), (_, grads) = step(model, taps)
    report = diagnostics.telemetry_report(fwd, grads)
    assert list(report) == [
        "attn/query",
        "attn/key",
        "attn/value",
        "attn/qk",
        "attn/pv",
        "attn/out",
        "mlp",
    ]
    assert all(np.isfinite(t.wgrad.sqnr_db_min) for t in report.values())


def test_misuse_is_refused_with_a_clear_error():
    params, x = make_params()
    with pytest.raises(KeyError, match="no tap for GEMM 'layer0'"):
        three_layers(params, x, {})

    def remat_inside(w, x):
        with diagnostics.telemetry():
            return jax.checkpoint(lambda x: jaxmx.dot_general(x, w, DIMS))(x).sum()

    with pytest.raises(ValueError, match="inside a transformation"):
        jax.grad(remat_inside)(params[0], x)

    with diagnostics.telemetry(), pytest.raises(ValueError, match="covers MX and NVFP4 recipes"):
        jaxmx.dot_general(x, params[0], DIMS, recipe=jaxmx.recipes.DEEPSEEK_FP8)


def test_unreadable_telemetry_is_refused_by_name():
    with pytest.raises(ValueError, match=r"leg_stats: x of shape \(0, 64\) is empty"):
        diagnostics.leg_stats(jnp.zeros((0, 64)), "mxfp8_e4m3", 1, "rceil")
    for bad in (None, 5, ""):
        with pytest.raises(TypeError, match="a GEMM name must be a non-empty str"):
            with diagnostics.named(bad):
                pass
    params, x = make_params()
    with pytest.raises(ValueError, match=r"GEMM 'layer0', leg lhs: x of shape .* is empty"):
        jax.eval_shape(lambda p, x: three_layers(p, x, None), params, x[:0])
    stats = diagnostics.leg_stats(jnp.ones((4, 32)), "mxfp8_e4m3", 1, "rceil")
    forward = {"a": diagnostics.ForwardLegs(jnp.int32(0), stats, stats)}
    report = diagnostics.telemetry_report(forward, {"a": diagnostics.GradientLegs(stats, stats)})
    assert list(report) == ["a"]
    with pytest.raises(ValueError, match=r"gradient entries \['b'\] match no forward GEMM"):
        diagnostics.telemetry_report(forward, {"b": diagnostics.GradientLegs(stats, stats)})


@pytest.mark.parametrize(
    "transform",
    [
        jax.checkpoint,
        jax.jit,
        lambda f: lambda x: jax.vmap(f)(x[None])[0],
        lambda f: lambda x: jax.lax.scan(lambda c, _: (f(c), None), x, None, length=2)[0],
    ],
    ids=["checkpoint", "jit", "vmap", "scan"],
)
def test_a_gemm_in_a_transformation_nested_in_the_block_is_refused(transform):
    """The block compares JAX's opaque trace state (jax.extend.core) at entry and at each GEMM."""
    w = jnp.ones((128, 128))

    def nested(x):
        with diagnostics.telemetry():
            return transform(lambda x: jaxmx.dot_general(x, w, DIMS))(x)

    with pytest.raises(ValueError, match="inside a transformation"):
        nested(jnp.ones((64, 128)))
    with diagnostics.telemetry() as record:  # the same GEMMs traced in the block's own trace
        jax.jit(lambda x: jaxmx.dot_general(x, w, DIMS))  # (not called: nothing recorded)
        jaxmx.dot_general(jnp.ones((64, 128)), w, DIMS)
    assert list(record.forward) == ["dot_general"]
