"""Multi-device (SPMD) scenarios, run by tests/test_spmd.py in a fresh process with 8 CPU devices.

    python tests/spmd_cases.py --out results.json [CASE ...]

Each case runs a sharded computation on both GEMM backends ("emulate" and "ffi") and compares it
with the same computation on one device (itself checked against numpy in test_dot_general.py and
test_ffi.py): bit for bit where no reduction is split across devices (ffi: its CPU handler sums
each output element in a fixed order whatever the shard shape), else within float32 summation
error (relative 2^-16, about 4000 times below MXFP8's own rounding error). It also reads the
collectives of the compiled HLO. A case returns a dict of observations or raises.

XLA_FLAGS=--xla_force_host_platform_device_count=8 is set here before jax is imported, so this
file must run in its own process (the rest of the suite imports jax with one device).
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxmx  # noqa: E402
from jaxmx import ffi  # noqa: E402
from jaxmx.partitioning import BlockShardingError  # noqa: E402

BACKENDS = ("emulate", "ffi")
DIMS = (((1,), (1,)), ((), ()))  # y = x @ w.T, weights [N, K]
M, D, F = 256, 64, 256  # tokens, model width, hidden width: whole blocks per shard everywhere
REL_TOL = 2.0**-16
CASES: dict[str, Callable[[], dict]] = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


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


_REFERENCES: dict = {}


def reference(key, fn, *args):
    """``jit(fn)(*args)`` on one device, computed once per key."""
    if key not in _REFERENCES:
        one = jax.devices()[0]
        _REFERENCES[key] = jax.jit(fn)(*jax.device_put(args, one))
    return _REFERENCES[key]


def compare(names, got, ref, exact=(), sum_abs=None) -> dict:
    """Max abs error per named leaf; raises unless exact (for names in ``exact``) or close."""
    errors = {}
    for name, g, r in zip(names, jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert g.shape == r.shape, f"{name}: shape {g.shape} vs single-device {r.shape}"
        err = float(np.abs(g - r).max())
        errors[name] = err
        if name in exact:
            assert np.array_equal(g, r), f"{name}: not bit-identical to one device (max {err})"
        else:
            scale = sum_abs[name] if sum_abs and name in sum_abs else float(np.abs(r).max())
            assert err <= REL_TOL * scale, f"{name}: max error {err} > 2^-16 x {scale}"
    return errors


def loss_scale(y, c) -> float:
    """sum |y * c|: the scale of the float32 summation error of the loss sum(y * c)."""
    return float(jnp.abs(jnp.asarray(y, jnp.float32) * c).sum())


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
    """Compiles ``fn`` and returns the BlockShardingError text it must raise."""
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


def run_mlp_layout(mesh, specs, exact_ffi, check_hlo) -> dict:
    """The MLP step with inputs (x, w1, w2, c) sharded by ``specs``, on both backends.

    Gradients come back sharded like their inputs (so FSDP ends with a reduce-scatter).
    """
    x_spec, w1_spec, w2_spec, c_spec = specs
    sh = lambda s: NamedSharding(mesh, s)
    in_sh = tuple(sh(s) for s in specs)
    out_sh = ((sh(P()), sh(c_spec)), (sh(x_spec), sh(w1_spec), sh(w2_spec)))
    args = mlp_inputs()
    info = {}
    for backend in BACKENDS:
        step = mlp_step(backend)
        ref = reference(("mlp", backend), step, *args)
        compiled = jax.jit(step, in_shardings=in_sh, out_shardings=out_sh).lower(*args).compile()
        got = compiled(*args)
        sum_abs = {"loss": loss_scale(ref[0][1], args[3])}
        exact = exact_ffi if backend == "ffi" else ()
        errors = compare(("loss", "y", "dx", "dw1", "dw2"), got, ref, exact, sum_abs)
        colls = collectives(compiled.as_text())
        check_hlo(backend, colls)
        info[backend] = {"max_abs_error": errors, "collectives": colls}
    return info


@case
def data_parallel():
    """Batch sharded over 8 devices, weights replicated: gradients all-reduced, no gathers."""

    def check(backend, colls):
        assert "all-gather" not in colls, colls
        assert "all-reduce" in colls, colls

    mesh = make_mesh((8,), ("data",))
    specs = (P("data"), P(), P(), P("data"))
    return run_mlp_layout(mesh, specs, ("y", "dx"), check)


@case
def fsdp():
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
    return run_mlp_layout(mesh, specs, ("y", "dx"), check)


@case
def tensor_parallel():
    """Megatron MLP over 8 devices: w1 column-parallel [F/8, D], w2 row-parallel [D, F/8].

    No weight is gathered; the row-parallel forward GEMM (K = F sharded) and the column-parallel
    input-gradient GEMM (N = F sharded) each end in an all-reduce.
    """

    def check(backend, colls):
        assert "all-gather" not in colls, colls
        assert len(colls.get("all-reduce", [])) >= 1, colls

    mesh = make_mesh((8,), ("model",))
    specs = (P(), P("model", None), P(None, "model"), P())
    return run_mlp_layout(mesh, specs, ("dw1", "dw2"), check)


@case
def data_and_tensor_parallel():
    """2-D mesh (data 2 x model 4): batch over data, Megatron weights over model."""

    def check(backend, colls):
        assert "all-gather" not in colls, colls
        assert "all-reduce" in colls, colls

    mesh = make_mesh((2, 4), ("data", "model"))
    specs = (P("data"), P("model", None), P(None, "model"), P("data"))
    return run_mlp_layout(mesh, specs, (), check)


@case
def fsdp_and_tensor_parallel():
    """2-D mesh: Megatron weights over model, and their other axis FSDP-sharded over data."""

    def check(backend, colls):
        assert colls.get("all-gather"), colls
        assert dtypes_of(colls["all-gather"]) == {"u8"}, colls["all-gather"]

    mesh = make_mesh((2, 4), ("data", "model"))
    specs = (P("data"), P("model", "data"), P("data", "model"), P("data"))
    return run_mlp_layout(mesh, specs, (), check)


# --- single layers: collectives and per-shard swizzle --------------------------------------


@case
def row_parallel_layer():
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
    info = {}
    for backend in BACKENDS:
        fn = gemm(backend)
        ref = reference(("row", backend), fn, h, w)
        compiled = jax.jit(fn, in_shardings=(sh(None, "model"), sh(None, "model"))).lower(h, w)
        compiled = compiled.compile()
        got = compiled(h, w)
        errors = compare(("y",), got.astype(jnp.float32), ref.astype(jnp.float32))
        hlo = compiled.as_text()
        colls = collectives(hlo)
        assert "all-gather" not in colls, colls
        assert colls.get("all-reduce") == ["f32[1,64,64]"], colls
        info[backend] = {"max_abs_error": errors, "collectives": colls}
        if backend == "ffi":
            calls = custom_call_operands(hlo)
            want = ["f8e4m3fn[1,64,32]", "f8e4m3fn[1,64,32]", "u8[1,512]", "u8[1,512]"]
            assert calls == [want], calls
            info[backend]["custom_call_operands"] = calls
    return info


@case
def sequence_parallel_reduce_scatter():
    """Row-parallel GEMM whose output is wanted sharded by rows, over K's axis: reduce-scatter."""
    mesh = make_mesh((8,), ("model",))
    sh = lambda *s: NamedSharding(mesh, P(*s))
    h = jax.random.normal(jax.random.key(1), (64, F))
    w = jax.random.normal(jax.random.key(2), (D, F))
    info = {}
    for backend in BACKENDS:
        fn = gemm(backend)
        ref = reference(("seq", backend), fn, h, w)
        jitted = jax.jit(
            fn, in_shardings=(sh(None, "model"), sh(None, "model")), out_shardings=sh("model")
        )
        compiled = jitted.lower(h, w).compile()
        errors = compare(("y",), compiled(h, w), ref)
        colls = collectives(compiled.as_text())
        assert colls == {"reduce-scatter": ["f32[1,8,64]"]}, colls
        info[backend] = {"max_abs_error": errors, "collectives": colls}
    return info


# --- Flax, vmap, shard_map ------------------------------------------------------------------


@case
def flax_linen_mlp():
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
    info = {}
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
        errors = compare(names, got, ref, sum_abs={"loss": loss_scale(ref[0][1], c)})
        colls = collectives(compiled.as_text())
        assert "all-gather" not in colls, colls
        info[backend] = {"max_abs_error": errors, "collectives": colls}
    return info


@case
def vmap_over_sharded_experts():
    """vmap of dot_general over a leading expert dim, tokens over data and experts' N over model.

    Also checks that the block check follows the vmapped axes: with 16 rows of w per device the
    error names the rhs axis N, not the expert or K axis.
    """
    mesh = make_mesh((2, 4), ("data", "model"))
    sh = lambda *s: NamedSharding(mesh, P(*s))
    x = jax.random.normal(jax.random.key(6), (2, 64, D))
    w = jax.random.normal(jax.random.key(7), (2, 128, D))
    c = jax.random.normal(jax.random.key(8), (2, 64, 128))
    info = {}
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
        sum_abs = {"loss": loss_scale(ref[0][1], c)}
        errors = compare(("loss", "y", "dx", "dw"), got, ref, sum_abs=sum_abs)
        narrow = jnp.ones((2, 64, D))  # N = 64 over 4 devices: 16 rows each
        text = expect_error(
            jax.jit(step, in_shardings=specs), x, narrow, c, contains=("rhs axis N (size 64",)
        )
        info[backend] = {"max_abs_error": errors, "error": text}
    return info


@case
def shard_map_data_parallel():
    """dot_general inside shard_map (per-device blocks): the weight gradient is psum'd by jaxmx."""
    mesh = make_mesh((8,), ("data",))
    x, w1, _, _ = mlp_inputs()
    c = jax.random.normal(jax.random.key(9), (M, F))
    info = {}
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
        errors = compare(("dx", "dw"), compiled(x, w1, c), ref, exact)
        colls = collectives(compiled.as_text())
        assert colls.get("all-reduce") == [f"f32[1,{F},{D}]"], colls
        info[backend] = {"max_abs_error": errors, "collectives": colls}
    return info


# --- misaligned shards -----------------------------------------------------------------------


@case
def misaligned_shards_raise():
    """A sharded reduction axis with 16 elements per device: BlockShardingError, naming it."""
    mesh = make_mesh((2, 4), ("data", "model"))
    sh = lambda *s: NamedSharding(mesh, P(*s))

    @jax.custom_vjp
    def split_cotangent(y):  # identity whose cotangent is sharded along its columns
        return y

    def bwd(_, g):
        return (jax.lax.with_sharding_constraint(g, sh(None, "model")),)

    split_cotangent.defvjp(lambda y: (y, None), bwd)
    a64 = jnp.ones((64, 64))
    msgs = {}
    for backend in BACKENDS:
        fwd = gemm(backend)
        train = jax.grad(lambda x, w, fwd=fwd: fwd(x, w).sum(), argnums=(0, 1))
        m = {}
        # K: a row-parallel layer with 16 hidden features per device
        m["K"] = expect_error(
            jax.jit(fwd, in_shardings=(sh(None, "model"), sh(None, "model"))),
            a64,
            a64,
            contains=(
                "jaxmx.dot_general: lhs axis K (size 64;",
                "over mesh axis 'model' into 4 shards of 16 elements",
                "K a multiple of 32 x 4 = 128",
            ),
        )
        # M: data parallel training with 16 tokens per device (wgrad reduces M)
        m["M"] = expect_error(
            jax.jit(train, in_shardings=(sh("data"), sh())),
            jnp.ones((32, 64)),
            a64,
            contains=("lhs axis M (size 32;", "weight-gradient", "mesh axis 'data' into 2"),
        )
        # N: column-parallel training with 16 output features per device (dgrad reduces N)
        m["N"] = expect_error(
            jax.jit(train, in_shardings=(sh(), sh("model"))),
            a64,
            a64,
            contains=("rhs axis N (size 64;", "input-gradient"),
        )

        # the output gradient arrives sharded along N (16 per device) from a later layer
        m["g"] = expect_error(
            jax.jit(
                jax.grad(lambda x, w, fwd=fwd: split_cotangent(fwd(x, w)).sum(), (0, 1)),
                in_shardings=(sh(), sh("data")),  # w: N over 2 devices, 32 rows each
            ),
            a64,
            a64,
            contains=("the output gradient axis N (size 64;", "input-gradient"),
        )

        # the GEMM APIs on MX operands check K themselves
        def direct(x, w, backend=backend):
            a, b = jaxmx.quantize(x), jaxmx.quantize(w)
            if backend == "ffi":
                return ffi.mx_matmul(a, b, jnp.float32)
            return jaxmx.matmul(a, b, jnp.float32, backend)

        where = "jaxmx.ffi.mx_matmul" if backend == "ffi" else "jaxmx.matmul"
        m["direct"] = expect_error(
            jax.jit(direct, in_shardings=(sh(None, "model"), sh(None, "model"))),
            a64,
            a64,
            contains=(f"{where}: the lhs axis K (size 64;",),
        )
        msgs[backend] = m
    return msgs


@case
def inference_needs_only_k_aligned():
    """Forward only: 8 tokens per device is fine (only the training GEMMs reduce over tokens)."""
    mesh = make_mesh((8,), ("data",))
    x, w1, _, _ = mlp_inputs()
    x = x[:64]
    info = {}
    for backend in BACKENDS:
        fn = gemm(backend)
        ref = reference(("infer", backend), fn, x, w1)
        sh = NamedSharding(mesh, P("data"))
        got = jax.jit(fn, in_shardings=(sh, NamedSharding(mesh, P())))(x, w1)
        exact = ("y",) if backend == "ffi" else ()
        info[backend] = {"max_abs_error": compare(("y",), got, ref, exact)}
    return info


@case
def explicit_axes_raise_while_tracing():
    """With Explicit mesh axes the sharding is in the type: the error comes at trace time."""
    mesh = make_mesh((2, 4), ("data", "model"), explicit=True)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((64, 64)), P(None, "model"))
        w = jnp.ones((32, 64))
        try:
            jax.jit(lambda x, w: jaxmx.dot_general(x, w, DIMS)).trace(x, w)
        except BlockShardingError as e:
            assert "lhs axis K (size 64;" in str(e), str(e)
            return {"error": str(e)}
    raise AssertionError("no BlockShardingError while tracing")


# --- the guide's example ---------------------------------------------------------------------


@case
def docs_distributed_example():
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
    return {"loss": float(scope["loss"]), "collectives": colls}


# --- driver -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("cases", nargs="*", help=f"cases to run (default all): {list(CASES)}")
    args = parser.parse_args()
    assert jax.device_count() == 8, f"expected 8 CPU devices, got {jax.devices()}"
    results = {}
    for name in args.cases or list(CASES):
        start = time.perf_counter()
        try:
            results[name] = {"ok": True, "info": CASES[name]()}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()[-6000:]}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
        status = "ok" if results[name]["ok"] else "FAILED"
        print(f"{name}: {status} ({results[name]['seconds']} s)", flush=True)
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
