"""Multi-device training with JAX SPMD on 8 CPU devices (tests/conftest.py asks for them).

Each test runs a sharded computation on both GEMM backends ("emulate" and "ffi") and compares it
with the same computation on one device (itself checked against numpy in test_dot_general.py and
test_ffi.py): bit for bit where no reduction is split across devices (ffi: its CPU handler sums
each output element in a fixed order whatever the shard shape), else within float32 summation
error: twice docs/native.md's bound of each GEMM from its own decoded operands, and of each
float32 sum (a loss, a bias gradient) from its terms (tests/bounds.py; :func:`mlp_bounds`,
:func:`layer_bounds`, :func:`gemm_bound`). Each step is built so that every tensor that gets
quantized comes out of an unsplit reduction (its loss is linear in the output): a layout then
changes no quantization. For the native GEMM, whose partitioning rule is jaxmx's, it also reads
the collectives of the compiled HLO; the emulation is plain JAX, partitioned by XLA.
"""

from __future__ import annotations

import pathlib
import re

import bounds
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_dot_general import ref_fake_quant

import jaxmx
from jaxmx import BlockShardingError, ffi

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest.py)")

BACKENDS = ("emulate", "ffi")
DIMS = (((1,), (1,)), ((), ()))  # y = x @ w.T, weights [N, K]
M, D, F = 256, 64, 256  # tokens, model width, hidden width: whole blocks per shard everywhere


# --- helpers ----------------------------------------------------------------------------------


def make_mesh(shape, names, explicit=False):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def recipe(backend):
    return jaxmx.recipes.MXFP8.replace(backend=backend)


def gemm(backend):
    """x [M, K], w [N, K] -> x @ w.T through jaxmx.dot_general on ``backend``."""
    r = recipe(backend)

    def fn(x, w):
        return jaxmx.dot_general(x, w, DIMS, recipe=r)

    return fn


def mlp_step(backend):
    """((loss, y), (dx, dw1, dw2)) of a Megatron-style MLP y = relu(x @ w1.T) @ w2.T.

    The loss is linear in y, so the output gradient is exact whatever the layout, and every tensor
    that gets quantized (x, w1, w2, h, g) comes out of an unsplit reduction: a layout changes only
    the float32 summation order of the results of split reductions, never a quantization.
    """
    r = recipe(backend)

    def loss(x, w1, w2, c):
        h = jax.nn.relu(jaxmx.dot_general(x, w1, DIMS, recipe=r))
        y = jaxmx.dot_general(h, w2, DIMS, recipe=r)
        return (y * c).sum(), y

    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)


def mlp_inputs():
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (M, D))
    w1 = jax.random.normal(k[1], (F, D)) * D**-0.5
    w2 = jax.random.normal(k[2], (D, F)) * F**-0.5
    c = jax.random.normal(k[3], (M, D))
    return x, w1, w2, c


def mlp_bounds(x, w1, w2, c) -> dict[str, np.ndarray]:
    """How far two runs of :func:`mlp_step` may differ, per result.

    Every tensor that gets quantized comes out of an unsplit reduction (:func:`mlp_step`), so
    each run's GEMMs have the same decoded operands, and each GEMM result (y, dx, dw1, dw2) is
    within twice docs/native.md's bound of the other run's (tests/bounds.py). The decoded
    operands are the numpy reference's quantization (rceil, E4M3) of the one-device
    intermediates h = relu(x @ w1.T) and dpre (the gradient at the pre-activation). The loss
    sum(y * c), a float32 sum of M * D rounded products, differs by at most twice its own
    accumulation bound plus sum |c| times y's bound.
    """
    r, cpu0 = recipe("emulate"), jax.devices()[0]
    x, w1, w2, c = (np.asarray(jax.device_put(a, cpu0)) for a in (x, w1, w2, c))
    pre = jaxmx.dot_general(x, w1, DIMS, recipe=r)
    h = jax.nn.relu(pre)
    dh = jax.vjp(lambda h: jaxmx.dot_general(h, w2, DIMS, recipe=r), h)[1](jnp.asarray(c))[0]
    h, dpre = np.asarray(h), np.asarray(jnp.where(pre > 0, dh, 0.0))
    fq = ref_fake_quant
    gemms = {
        "y": (fq(h), fq(w2)),
        "dx": (fq(dpre), fq(w1.T)),
        "dw1": (fq(dpre.T), fq(x.T)),
        "dw2": (fq(c.T), fq(h.T)),
    }
    out = {}
    for name, (a, b) in gemms.items():
        out[name] = bounds.between(bounds.abs_products(a, b), a.shape[-1], a @ b.T)
    y = gemms["y"][0] @ gemms["y"][1].T
    acc = bounds.accumulation(np.abs(y * c).sum(), c.size, 1)
    out["loss"] = 2 * acc + (np.abs(c) * out["y"]).sum()
    return out


def gemm_bound(h, w, want) -> np.ndarray:
    """Twice docs/native.md's bound of y = h @ w.T (tests/bounds.py) from the decoded operands
    (the numpy reference's quantization, rceil E4M3), rounded to ``want``'s dtype."""
    a, b = ref_fake_quant(h), ref_fake_quant(w)
    want64 = np.asarray(want, np.float64)
    return bounds.between(bounds.abs_products(a, b), a.shape[-1], want64, want.dtype)


def layer_bounds(x, w, c) -> dict[str, np.ndarray]:
    """How far two runs of y = x @ w.T (leading batch dims allowed) with the output gradient
    ``c`` may differ, per result: twice docs/native.md's bound of each GEMM (y, dx, dw) from its
    decoded operands (tests/bounds.py, rceil E4M3 copies as docs/training_gemm.md lists them),
    and for the loss sum(y * c) twice its float32 accumulation bound plus sum |c| times y's."""
    swap = lambda v: np.swapaxes(v, -1, -2)
    fq = ref_fake_quant
    x, w, c = (np.asarray(v, np.float32) for v in (x, w, c))
    gemms = {
        "y": (fq(x), fq(w)),
        "dx": (fq(c), fq(swap(w))),
        "dw": (fq(swap(c)), fq(swap(x))),
    }
    out = {}
    for name, (a, b) in gemms.items():
        exact = a @ swap(b)
        out[name] = bounds.between(bounds.abs_products(a, b), a.shape[-1], exact)
    y = gemms["y"][0] @ swap(gemms["y"][1])
    acc = bounds.accumulation(np.abs(y * c).sum(), c.size, 1)
    out["loss"] = 2 * acc + (np.abs(c) * out["y"]).sum()
    return out


_REFERENCES: dict = {}


def reference(key, fn, *args):
    """``jit(fn)(*args)`` on one device, computed once per key."""
    if key not in _REFERENCES:
        one = jax.devices()[0]
        _REFERENCES[key] = jax.jit(fn)(*jax.device_put(args, one))
    return _REFERENCES[key]


def compare(names, got, ref, exact=(), within=None) -> dict:
    """Max abs error per named leaf; raises unless exact (for names in ``exact``) or within the
    bound ``within[name]`` (tests/bounds.py)."""
    errors = {}
    for name, g, r in zip(names, jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert g.shape == r.shape, f"{name}: shape {g.shape} vs single-device {r.shape}"
        err = float(np.abs(g - r).max())
        errors[name] = err
        if name in exact:
            assert np.array_equal(g, r), f"{name}: not bit-identical to one device (max {err})"
        else:
            assert within is not None and name in within, f"{name}: no bound given"
            bounds.assert_within(g, r, within[name], name)
    return errors


_COLLECTIVE = re.compile(
    r"=\s*(\([^)]*\)|\S+)\s+(all-gather|all-reduce|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\("
)


def collectives(hlo: str) -> dict[str, list[str]]:
    """Collective op -> the result types ("u8[1,256,64]") of each instance in compiled HLO."""
    found: dict[str, list[str]] = {}
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            types = re.findall(r"([a-z][a-z0-9]*\[[0-9,]*\])", m.group(1))
            found.setdefault(m.group(2), []).append(" ".join(types))
    return found


def dtypes_of(entries: list[str]) -> set[str]:
    return {t.split("[")[0] for e in entries for t in e.split()}


def custom_call_operands(hlo: str) -> list[list[str]]:
    """Operand types of each jaxmx_mx_matmul custom call in compiled HLO."""
    out = []
    for line in hlo.splitlines():
        if 'custom_call_target="jaxmx_mx_matmul"' in line:
            constraints = line.split("operand_layout_constraints=", 1)[1]
            out.append(re.findall(r"([a-z][a-z0-9]*\[[0-9,]*\])\{", constraints)[:4])
    return out


def expect_error(fn, *args, contains=()) -> str:
    """Compiles ``fn`` and returns the BlockShardingError text it must raise (while tracing, or
    from the native GEMM's partitioning rule, which XLA reports inside its own error)."""
    try:
        fn.lower(*args).compile()
    except BlockShardingError as e:  # raised while tracing (Explicit mesh axes)
        text = str(e)
    except Exception as e:  # raised by XLA's partitioner, wrapped in a JaxRuntimeError
        m = re.search(r"BlockShardingError: (.*)", str(e))
        assert m, f"expected a BlockShardingError, got {type(e).__name__}: {str(e)[:2000]}"
        text = m.group(1)
    else:
        raise AssertionError("expected a BlockShardingError, compiled fine")
    for part in contains:
        assert part in text, f"{part!r} not in the message: {text}"
    return text


# --- training-step layouts ------------------------------------------------------------------


def run_mlp_layout(mesh, specs, exact_ffi, check_hlo) -> None:
    """The MLP step with inputs (x, w1, w2, c) sharded by ``specs``, on both backends.

    Gradients come back sharded like their inputs (so FSDP ends with a reduce-scatter).
    """
    x_spec, w1_spec, w2_spec, c_spec = specs
    sh = lambda s: NamedSharding(mesh, s)
    in_sh = tuple(sh(s) for s in specs)
    out_sh = ((sh(P()), sh(c_spec)), (sh(x_spec), sh(w1_spec), sh(w2_spec)))
    args = mlp_inputs()
    for backend in BACKENDS:
        step = mlp_step(backend)
        ref = reference(("mlp", backend), step, *args)
        compiled = jax.jit(step, in_shardings=in_sh, out_shardings=out_sh).lower(*args).compile()
        got = compiled(*args)
        exact = exact_ffi if backend == "ffi" else ()
        within = mlp_bounds(*args)
        compare(("loss", "y", "dx", "dw1", "dw2"), got, ref, exact, within=within)
        if backend == "ffi":  # jaxmx's partitioning rule; XLA partitions the emulation
            check_hlo(backend, collectives(compiled.as_text()))


def test_data_parallel():
    """Batch sharded over 8 devices, weights replicated: gradients all-reduced, no gathers."""

    def check(backend, colls):
        assert "all-gather" not in colls, colls
        assert "all-reduce" in colls, colls

    mesh = make_mesh((8,), ("data",))
    specs = (P("data"), P(), P(), P("data"))
    run_mlp_layout(mesh, specs, ("y", "dx"), check)


def test_fsdp():
    """Weights sharded over the data axis too (ZeRO-3 style): gathered as 1-byte MX copies.

    Every all-gather moves uint8 (the E4M3 codes and E8M0 scales of the quantized weights, never
    float32 weights), and the weight gradients end in a reduce-scatter.
    """

    def check(backend, colls):
        assert colls.get("all-gather"), colls
        assert dtypes_of(colls["all-gather"]) == {"u8"}, colls["all-gather"]
        assert "reduce-scatter" in colls, colls

    mesh = make_mesh((8,), ("data",))
    specs = (P("data"), P("data", None), P(None, "data"), P("data"))
    run_mlp_layout(mesh, specs, ("y", "dx"), check)


def test_tensor_parallel():
    """Megatron MLP over 8 devices: w1 column-parallel [F/8, D], w2 row-parallel [D, F/8].

    No weight is gathered; the row-parallel forward GEMM (K = F sharded) and the column-parallel
    input-gradient GEMM (N = F sharded) each end in an all-reduce.
    """

    def check(backend, colls):
        assert "all-gather" not in colls, colls
        assert len(colls.get("all-reduce", [])) >= 1, colls

    mesh = make_mesh((8,), ("model",))
    specs = (P(), P("model", None), P(None, "model"), P())
    run_mlp_layout(mesh, specs, ("dw1", "dw2"), check)


def test_data_and_tensor_parallel():
    """2-D mesh (data 2 x model 4): batch over data, Megatron weights over model."""

    def check(backend, colls):
        assert "all-gather" not in colls, colls
        assert "all-reduce" in colls, colls

    mesh = make_mesh((2, 4), ("data", "model"))
    specs = (P("data"), P("model", None), P(None, "model"), P("data"))
    run_mlp_layout(mesh, specs, (), check)


def test_fsdp_and_tensor_parallel():
    """2-D mesh: Megatron weights over model, and their other axis FSDP-sharded over data."""

    def check(backend, colls):
        assert colls.get("all-gather"), colls
        assert dtypes_of(colls["all-gather"]) == {"u8"}, colls["all-gather"]

    mesh = make_mesh((2, 4), ("data", "model"))
    specs = (P("data"), P("model", "data"), P("data", "model"), P("data"))
    run_mlp_layout(mesh, specs, (), check)


# --- single layers: collectives and per-shard swizzle --------------------------------------


def test_row_parallel_layer():
    """One row-parallel GEMM y = h @ w.T, K sharded over 8 devices, bfloat16 in and out.

    HLO: no all-gather of the weight; one all-reduce, of float32 partial sums (rounded to
    bfloat16 once, after the sum). ffi: the custom call gets each device's codes [1, 64, 32] and
    scales swizzled per device (64 rows -> 128, 1 K-block -> 4: 512 bytes; a global swizzle of the
    8 K-blocks would be 1024 bytes).
    """
    mesh = make_mesh((8,), ("model",))
    sh = lambda *s: NamedSharding(mesh, P(*s))
    h = jax.random.normal(jax.random.key(1), (64, F), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (D, F), jnp.bfloat16)
    for backend in BACKENDS:
        fn = gemm(backend)
        ref = reference(("row", backend), fn, h, w)
        compiled = jax.jit(fn, in_shardings=(sh(None, "model"), sh(None, "model"))).lower(h, w)
        compiled = compiled.compile()
        got = compiled(h, w)
        within = {"y": gemm_bound(h, w, ref)}
        compare(("y",), got.astype(jnp.float32), ref.astype(jnp.float32), within=within)
        if backend == "ffi":
            hlo = compiled.as_text()
            colls = collectives(hlo)
            assert "all-gather" not in colls, colls
            assert colls.get("all-reduce") == ["f32[1,64,64]"], colls
            calls = custom_call_operands(hlo)
            want = ["f8e4m3fn[1,64,32]", "f8e4m3fn[1,64,32]", "u8[1,512]", "u8[1,512]"]
            assert calls == [want], calls


def test_sequence_parallel_reduce_scatter():
    """Row-parallel GEMM whose output is wanted sharded by rows, over K's axis: reduce-scatter."""
    mesh = make_mesh((8,), ("model",))
    sh = lambda *s: NamedSharding(mesh, P(*s))
    h = jax.random.normal(jax.random.key(1), (64, F))
    w = jax.random.normal(jax.random.key(2), (D, F))
    for backend in BACKENDS:
        fn = gemm(backend)
        ref = reference(("seq", backend), fn, h, w)
        jitted = jax.jit(
            fn, in_shardings=(sh(None, "model"), sh(None, "model")), out_shardings=sh("model")
        )
        compiled = jitted.lower(h, w).compile()
        compare(("y",), compiled(h, w), ref, within={"y": gemm_bound(h, w, ref)})
        if backend == "ffi":
            colls = collectives(compiled.as_text())
            assert colls == {"reduce-scatter": ["f32[1,8,64]"]}, colls


# --- Flax, vmap, shard_map ------------------------------------------------------------------


def flax_mlp_bounds(model, params, x, c) -> dict[str, np.ndarray]:
    """:func:`mlp_bounds` for :func:`test_flax_linen_mlp`'s MLP (Dense kernels [in, out], with
    biases): y and each kernel gradient within twice their GEMM's bound, each bias gradient (a
    float32 sum over the tokens) within twice its accumulation bound, the loss as there. The
    biases are Flax's zero init: adding them rounds nothing."""
    import jaxmx.flax.linen as mxl

    p = params["params"]
    _, seen = model.apply(params, x, capture_intermediates=True, mutable=["intermediates"])
    pre = seen["intermediates"]["up"]["__call__"][0]
    down = mxl.Dense(x.shape[-1], recipe=model.recipe)
    y, pullback = jax.vjp(lambda h: down.apply({"params": p["down"]}, h), jax.nn.relu(pre))
    dpre = jnp.where(pre > 0, pullback(c)[0], 0.0)
    tokens = lambda v: np.asarray(v, np.float32).reshape(-1, v.shape[-1])  # [tokens, features]
    x, c, h, dpre = (tokens(v) for v in (x, c, jax.nn.relu(pre), dpre))
    fq = ref_fake_quant
    gemms = {
        "y": (fq(h), fq(np.asarray(p["down"]["kernel"]).T)),
        "params/down/kernel": (fq(h.T), fq(c.T)),
        "params/up/kernel": (fq(x.T), fq(dpre.T)),
    }
    out = {}
    for name, (a, b) in gemms.items():
        out[name] = bounds.between(bounds.abs_products(a, b), a.shape[-1], a @ b.T)
    out["y"] = out["y"].reshape(np.shape(y))
    for name, g in (("params/down/bias", c), ("params/up/bias", dpre)):
        out[name] = 2 * bounds.accumulation(np.abs(g).sum(0), len(g), 0)
    y_exact = gemms["y"][0] @ gemms["y"][1].T
    acc = bounds.accumulation(np.abs(y_exact * c).sum(), c.size, 1)
    out["loss"] = 2 * acc + (np.abs(c) * out["y"].reshape(c.shape)).sum()
    return out


def test_flax_linen_mlp():
    """jaxmx.flax.linen.Dense MLP on x [batch, seq, width]: batch over data, Megatron over model."""
    import flax.linen as nn

    import jaxmx.flax.linen as mxl

    class MLP(nn.Module):
        hidden: int
        recipe: jaxmx.Recipe

        @nn.compact
        def __call__(self, x):
            h = nn.relu(mxl.Dense(self.hidden, recipe=self.recipe, name="up")(x))
            return mxl.Dense(x.shape[-1], recipe=self.recipe, name="down")(h)

    mesh = make_mesh((2, 4), ("data", "model"))
    sh = lambda *s: NamedSharding(mesh, P(*s))
    x = jax.random.normal(jax.random.key(3), (4, 16, D))  # 2 x 16 = 32 tokens per data shard
    c = jax.random.normal(jax.random.key(4), (4, 16, D))
    param_sh = {
        "params": {
            "up": {"kernel": sh(None, "model"), "bias": sh("model")},
            "down": {"kernel": sh("model", None), "bias": sh()},
        }
    }
    for backend in BACKENDS:
        model = MLP(F // 2, recipe(backend))
        params = model.init(jax.random.key(5), x)

        def step(params, x, c, model=model):
            def loss(p):
                y = model.apply(p, x)
                return (y * c).sum(), y

            return jax.value_and_grad(loss, has_aux=True)(params)

        ref = reference(("flax", backend), step, params, x, c)
        jitted = jax.jit(step, in_shardings=(param_sh, sh("data"), sh("data")))
        compiled = jitted.lower(params, x, c).compile()
        got = compiled(params, x, c)
        paths = [path for path, _ in jax.tree.leaves_with_path(ref[1])]
        names = ["loss", "y"] + ["/".join(str(k.key) for k in path) for path in paths]
        within = flax_mlp_bounds(model, params, x, c)
        compare(names, got, ref, within=within)
        if backend == "ffi":
            colls = collectives(compiled.as_text())
            assert "all-gather" not in colls, colls


def test_vmap_over_sharded_experts():
    """vmap of dot_general over a leading expert dim, tokens over data and experts' N over model.

    Also checks that the block check follows the vmapped axes: with 16 rows of w per device the
    error names the rhs axis N, not the expert or K axis.
    """
    mesh = make_mesh((2, 4), ("data", "model"))
    sh = lambda *s: NamedSharding(mesh, P(*s))
    x = jax.random.normal(jax.random.key(6), (2, 64, D))
    w = jax.random.normal(jax.random.key(7), (2, 128, D))
    c = jax.random.normal(jax.random.key(8), (2, 64, 128))
    for backend in BACKENDS:
        r = recipe(backend)

        def loss(x, w, c, r=r):
            y = jax.vmap(lambda x, w: jaxmx.dot_general(x, w, DIMS, recipe=r))(x, w)
            return (y * c[..., : y.shape[-1]]).sum(), y

        step = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        ref = reference(("vmap", backend), step, x, w, c)
        specs = (sh(None, "data"), sh(None, "model"), sh())
        compiled = jax.jit(step, in_shardings=specs).lower(x, w, c).compile()
        got = compiled(x, w, c)
        compare(("loss", "y", "dx", "dw"), got, ref, within=layer_bounds(x, w, c))
        narrow = w[:, :64]  # N = 64 over 4 devices: 16 rows each, half an MX block
        if backend == "ffi":  # jaxmx's partitioning rule refuses to split a block
            expect_error(
                jax.jit(step, in_shardings=specs),
                x,
                narrow,
                c,
                contains=("the lhs axis K (size 64",),
            )
        else:  # XLA partitions the emulation: blocks are gathered, never split
            ref = reference(("vmap-narrow", backend), step, x, narrow, c)
            got = jax.jit(step, in_shardings=specs)(x, narrow, c)
            within = layer_bounds(x, narrow, c[..., :64])
            compare(("loss", "y", "dx", "dw"), got, ref, within=within)


def test_shard_map_data_parallel():
    """dot_general inside shard_map (per-device blocks): the weight gradient is psum'd by jaxmx."""
    mesh = make_mesh((8,), ("data",))
    x, w1, _, _ = mlp_inputs()
    c = jax.random.normal(jax.random.key(9), (M, F))
    for backend in BACKENDS:
        r = recipe(backend)

        def loss(x, w, c, r=r):
            return (jaxmx.dot_general(x, w, DIMS, recipe=r) * c).sum()

        grad = jax.grad(loss, argnums=(0, 1))
        ref = reference(("shard_map", backend), grad, x, w1, c)
        local = jax.shard_map(
            grad, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=(P("data"), P())
        )
        compiled = jax.jit(local).lower(x, w1, c).compile()
        exact = ("dx",) if backend == "ffi" else ()
        compare(("dx", "dw"), compiled(x, w1, c), ref, exact, within=layer_bounds(x, w1, c))
        colls = collectives(compiled.as_text())
        assert colls.get("all-reduce") == [f"f32[1,{F},{D}]"], colls


# --- misaligned shards -----------------------------------------------------------------------


def misaligned_layouts(mesh) -> dict:
    """Layouts that put 16 elements of a reduction axis on each device: name -> (fn, args)."""
    sh = lambda *s: jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P(*s)))
    return {
        # K: a row-parallel layer with 16 hidden features per device
        "K": (False, (sh(None, "model"), sh(None, "model"))),
        # M: data-parallel training with 16 tokens per device (wgrad reduces M)
        "M": (True, (jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P("data"))), sh())),
        # N: column-parallel training with 16 output features per device (dgrad reduces N)
        "N": (True, (sh(), sh("model"))),
    }


MISALIGNED_MESSAGES = {
    "K": (
        "jaxmx.dot_general: lhs axis K (size 64;",
        "over mesh axis 'model' into 4 shards of 16 elements",
        "K a multiple of 32 x 4 = 128",
    ),
    "M": ("lhs axis M (size 32;", "weight-gradient", "mesh axis 'data' into 2"),
    "N": ("rhs axis N (size 64;", "input-gradient"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("axis", ["K", "M", "N"])
def test_misaligned_shards_raise_block_sharding_error_under_jit(backend, axis):
    """Inputs sharded on jax.make_mesh's default (Explicit) axes, shardings left to jit."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    training, args = misaligned_layouts(mesh)[axis]
    fwd = gemm(backend)
    fn = jax.grad(lambda x, w: fwd(x, w).sum(), argnums=(0, 1)) if training else fwd
    with pytest.raises(BlockShardingError) as caught:
        jax.jit(fn)(*args)
    for part in MISALIGNED_MESSAGES[axis]:
        assert part in str(caught.value)


def test_quantize_refuses_to_split_a_block_across_devices():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    _, (x, _) = misaligned_layouts(mesh)["K"]
    with pytest.raises(BlockShardingError, match=r"jaxmx.quantize: x axis 1 .* 4 shards of 16"):
        jax.jit(jaxmx.quantize)(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_mx_gemm_apis_check_k_themselves(backend):
    """MX operands whose codes arrive with K split mid-block (16 per device)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    q = jaxmx.quantize(jnp.ones((64, 64)))
    split = jax.device_put(q.data, NamedSharding(mesh, P(None, "model")))
    a = jaxmx.MXArray(split, q.scale, q.fmt, q.axis, q.shape)

    def direct(a, b):
        if backend == "ffi":
            return ffi.mx_matmul(a, b, jnp.float32)
        return jaxmx.matmul(a, b, jnp.float32, backend)

    where = "jaxmx.ffi.mx_matmul" if backend == "ffi" else "jaxmx.matmul"
    with pytest.raises(BlockShardingError, match=f"{where}: a axis K"):
        jax.jit(direct)(a, q)


@pytest.mark.parametrize("axis", ["K", "M", "N"])
def test_auto_axes_native_rule_refuses_and_emulation_gathers(axis):
    """Auto mesh axes: the sharding is chosen inside XLA. The native GEMM's partitioning rule
    raises BlockShardingError (reported inside XLA's compile error); XLA partitions the
    emulation itself and gathers what a shard cannot hold, so its result is the one-device one.
    """
    mesh = make_mesh((2, 4), ("data", "model"))
    training, args = misaligned_layouts(mesh)[axis]
    for backend in BACKENDS:
        fwd = gemm(backend)
        fn = jax.grad(lambda x, w, fwd=fwd: fwd(x, w).sum(), argnums=(0, 1)) if training else fwd
        if backend == "ffi":
            expect_error(jax.jit(fn), *args, contains=("jaxmx.ffi.mx_matmul: the lhs axis K",))
        else:
            ref = reference(("misaligned", axis), fn, *args)
            names = ("out",) * len(jax.tree.leaves(ref))
            # all-ones operands: every partial sum is an exact integer, in any order
            compare(names, jax.jit(fn)(*args), ref, exact=("out",))


def test_a_misaligned_output_gradient_from_a_later_layer():
    """The output gradient arrives sharded along N, 16 per device (native rule, Auto axes)."""
    mesh = make_mesh((2, 4), ("data", "model"))
    sh = lambda *s: NamedSharding(mesh, P(*s))

    @jax.custom_vjp
    def split_cotangent(y):  # identity whose cotangent is sharded along its columns
        return y

    def bwd(_, g):
        return (jax.lax.with_sharding_constraint(g, sh(None, "model")),)

    split_cotangent.defvjp(lambda y: (y, None), bwd)
    a64 = jnp.ones((64, 64))
    fwd = gemm("ffi")
    train = jax.grad(lambda x, w: split_cotangent(fwd(x, w)).sum(), (0, 1))
    expect_error(
        jax.jit(train, in_shardings=(sh(), sh("data"))),  # w: N over 2 devices, 32 rows each
        a64,
        a64,
        contains=("jaxmx.ffi.mx_matmul: the lhs axis K (size 64;",),
    )


def test_inference_needs_only_k_aligned():
    """Forward only: 8 tokens per device is fine (only the training GEMMs reduce over tokens)."""
    mesh = make_mesh((8,), ("data",))
    x, w1, _, _ = mlp_inputs()
    x = x[:64]
    for backend in BACKENDS:
        fn = gemm(backend)
        ref = reference(("infer", backend), fn, x, w1)
        sh = NamedSharding(mesh, P("data"))
        got = jax.jit(fn, in_shardings=(sh, NamedSharding(mesh, P())))(x, w1)
        exact = ("y",) if backend == "ffi" else ()
        compare(("y",), got, ref, exact, within={"y": gemm_bound(x, w1, ref)})


def test_explicit_axes_raise_while_tracing():
    """With Explicit mesh axes the sharding is in the type: the error comes at trace time."""
    mesh = make_mesh((2, 4), ("data", "model"), explicit=True)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((64, 64)), P(None, "model"))
        w = jnp.ones((32, 64))
        with pytest.raises(BlockShardingError, match="lhs axis K \\(size 64;"):
            jax.jit(lambda x, w: jaxmx.dot_general(x, w, DIMS)).trace(x, w)


# --- the guide's example ---------------------------------------------------------------------


def test_docs_distributed_example():
    """The first python block of docs/distributed.md runs as written (8 CPU devices)."""
    doc = pathlib.Path(__file__).resolve().parent.parent / "docs" / "distributed.md"
    block = re.search(r"```python\n(.*?)```", doc.read_text(), re.S)
    assert block, "no python block in docs/distributed.md"
    scope: dict = {}
    exec(compile(block.group(1), str(doc), "exec"), scope)
    assert np.isfinite(float(scope["loss"])), scope["loss"]
    args = (scope["params"], scope["opt_state"], scope["x"], scope["y"])
    colls = collectives(scope["train_step"].lower(*args).compile().as_text())
    assert "all-gather" not in colls and "all-reduce" in colls, colls


# --- export ----------------------------------------------------------------------------------


def test_a_one_device_training_step_round_trips_through_jax_export():
    """The MLP training step with the default recipe on one device, serialized with jax.export
    and deserialized, gives the same result (no host callbacks: on one device the emulated
    GEMMs' partitioning rule is inlined)."""
    step = jax.jit(mlp_step("auto"))
    args = jax.device_put(mlp_inputs(), jax.devices()[0])
    exported = jax.export.export(step)(*args)
    assert exported.nr_devices == 1
    restored = jax.export.deserialize(exported.serialize())
    want = step(*args)
    got = jax.jit(restored.call)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_sharded_training_step_round_trips_through_jax_export():
    """The FSDP MLP step (weights sharded over the batch axis) on 8 devices: exported (the GEMMs
    lowered without their custom_partitioning rule, with one warning naming it), serialized,
    deserialized and run on the mesh, it gives the unexported step's results within float32
    summation error. The cost is the one docs/distributed.md (Export) lists: the exported step
    gathers the float32 weights where the unexported one gathers 8-bit codes and scales."""
    mesh = make_mesh((8,), ("data",))
    specs = (P("data"), P("data", None), P(None, "data"), P("data"))
    sh = lambda s: NamedSharding(mesh, s)
    in_sh = tuple(sh(s) for s in specs)
    out_sh = ((sh(P()), sh(specs[3])), in_sh[:3])  # gradients sharded like their inputs
    step = jax.jit(mlp_step("auto"), in_shardings=in_sh, out_shardings=out_sh)
    args = jax.device_put(mlp_inputs(), in_sh)
    with pytest.warns(UserWarning, match="lowered for jax.export without its custom_partitioning"):
        exported = jax.export.export(step)(*args)
    assert exported.nr_devices == 8
    restored = jax.jit(jax.export.deserialize(exported.serialize()).call)
    want, got = step(*args), restored(*args)
    compare(("loss", "y", "dx", "dw1", "dw2"), got, want, within=mlp_bounds(*args))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
    unexported = collectives(step.lower(*args).compile().as_text())
    assert dtypes_of(unexported["all-gather"]) == {"u8"}, unexported
    assert "reduce-scatter" in unexported, unexported
    exported_colls = collectives(restored.lower(*args).compile().as_text())
    gathered = exported_colls["all-gather"]
    assert "f32" in dtypes_of(gathered) and "u8" not in dtypes_of(gathered), gathered
    assert "reduce-scatter" not in exported_colls, exported_colls


# --- Explicit mesh axes -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_under_explicit_axes(backend):
    """A Megatron MLP step on jax.make_mesh's default (Explicit) axes: the results are the
    one-device ones (within :func:`mlp_bounds`: the loss is linear in the output, as in
    :func:`mlp_step`) and every gradient keeps its parameter's sharding in its type."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    r = recipe(backend)
    dims = (((2,), (1,)), ((), ()))  # x [batch, seq, d] . w [n, d]

    def loss(params, x, c):
        h = jax.nn.relu(jaxmx.dot_general(x, params["up"], dims, recipe=r))
        return (jaxmx.dot_general(h, params["down"], dims, recipe=r) * c).sum()

    k = jax.random.split(jax.random.key(10), 4)
    params = {
        "up": jax.random.normal(k[0], (F, D)) * D**-0.5,
        "down": jax.random.normal(k[1], (D, F)) * F**-0.5,
    }
    x, c = jax.random.normal(k[2], (4, 64, D)), jax.random.normal(k[3], (4, 64, D))
    ref = reference(("explicit", backend), jax.value_and_grad(loss), params, x, c)
    specs = {"up": P("model", None), "down": P(None, "model")}
    sharded = jax.device_put(params, {n: NamedSharding(mesh, s) for n, s in specs.items()})
    xs, cs = jax.device_put((x, c), NamedSharding(mesh, P("data")))
    value, grads = jax.jit(jax.value_and_grad(loss))(sharded, xs, cs)
    for name, spec in specs.items():
        assert jax.typeof(grads[name]).sharding.spec == spec, (name, jax.typeof(grads[name]))
    got, want = (value, grads["up"], grads["down"]), (ref[0], ref[1]["up"], ref[1]["down"])
    tokens = lambda v: v.reshape(-1, D)  # [4, 64, D] as 256 tokens (the blocks stay whole)
    within = mlp_bounds(tokens(x), params["up"], params["down"], tokens(c))
    within = {"loss": within["loss"], "dup": within["dw1"], "ddown": within["dw2"]}
    compare(("loss", "dup", "ddown"), got, want, within=within)


def test_explicit_axes_inference_needs_only_k_aligned():
    """Merged lhs free dims: batch 2 over data x seq 4 = 4 tokens per device, fine without a
    gradient; with one, the weight-gradient GEMM would split a block."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x = jax.device_put(jnp.ones((2, 4, D)), NamedSharding(mesh, P("data")))
    w = jnp.ones((32, D))
    dims = (((2,), (1,)), ((), ()))
    y = jax.jit(lambda x, w: jaxmx.dot_general(x, w, dims))(x, w)
    assert y.shape == (2, 4, 32) and jax.typeof(y).sharding.spec[0] == "data"
    train = jax.grad(lambda x, w: jaxmx.dot_general(x, w, dims).sum(), argnums=1)
    with pytest.raises(BlockShardingError, match=r"lhs axis M \(size 8;.* 2 shards of 4"):
        jax.jit(train)(x, w)
