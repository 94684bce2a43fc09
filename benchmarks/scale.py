"""Collective bytes, memory and step time of an MLP block's training step on an 8-device mesh.

Each layout builds one jitted training step (``jax.value_and_grad`` of a squared loss with
respect to the weights) of the MLP block ``y = gelu(x . w1^T) . w2^T``, ``x [batch, d]``
bfloat16 sharded on its batch, float32 weights ``w1 [hidden, d]`` and ``w2 [d, hidden]``, for
BF16 (``lax.dot_general`` on bfloat16 casts) and each recipe (``jaxmx.dot_general``). For each it
prints, from the compiled program: the bytes each collective moves per step by HLO dtype
(``jaxmx.diagnostics.collective_bytes``: all-gather AG, all-reduce AR, reduce-scatter RS,
all-to-all A2A), ``memory_analysis()``'s peak temporary buffer and argument / output sizes, and
the step time (median of interleaved repeats after a compiling call, benchmarks/timing.py),
with the gathered bytes (AG x), all collective bytes (wire x), peak temporary and time as
ratios to BF16 in the same layout and run.

Layouts (``--layouts``):

- ``fsdp_auto``, ``fsdp_explicit``: ``jax.make_mesh((8,), ("fsdp",))``, the weights sharded on
  their first dimension, Auto or Explicit mesh axes;
- ``fsdp_tp``: a ``(4, 2)`` ``("fsdp", "model")`` mesh, Megatron over ``model`` (``w1`` rows and
  ``w2`` columns), the weights' other dimension and the batch over ``fsdp``;
- ``fsdp_shard_map``: ``jax.shard_map`` over ``fsdp`` with ``jaxmx.fsdp_dot_general`` (BF16:
  ``lax.all_gather`` of the bfloat16 casts); recipes the helper refuses are listed as such;
- ``moe_ep``: the expert-parallel MoE FFN ``jaxmx.expert_parallel_ffn`` on ``(8,) ("expert",)``
  (benchmarks/scale_moe.py's step): ``batch`` bfloat16 tokens of ``d``, 16 experts
  ``[d, hidden]`` / ``[hidden, d]`` in bfloat16, top-2, capacity factor 1.25; BF16 is
  ``recipe=None`` (the tokens dispatched in bfloat16, stock ``lax.ragged_dot``).

One more layout is one more function ``(recipe, args) -> Case`` in :data:`LAYOUTS`.

    python benchmarks/scale.py --repeats 3
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import scale_moe
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from timing import interleaved_medians

import jaxmx

R = jaxmx.recipes
RECIPES = {
    "bf16": None,
    "mxfp8": R.MXFP8,
    "mxfp8_2d": R.MXFP8_2D,
    "fp8_tensorwise": R.FP8_TENSORWISE,
    "fp8_rowwise": R.FP8_ROWWISE,
    "mxfp4": R.MXFP4,
    "nvfp4": R.NVFP4,
}
"""The recipes that can be compared; ``None`` is BF16 (always run: the ratios' reference)."""

DEFAULT_RECIPES = ("bf16", "mxfp8", "mxfp8_2d", "fp8_tensorwise", "fp8_rowwise")
KINDS = {"AG": "all-gather", "AR": "all-reduce", "RS": "reduce-scatter", "A2A": "all-to-all"}
NT = (((1,), (1,)), ((), ()))  # x [M, K] . w [N, K] -> [M, N]
MIB = 2**20
KEY = jax.random.key(0)  # the stochastic-rounding key of the steps


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One layout's training step: ``step(*args)`` (jitted) returns ``(loss, grads)``."""

    step: Callable
    args: tuple


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shapes:
    batch: int
    d: int
    hidden: int


def operands(shapes: Shapes):
    """``(x, (w1, w2))`` on the host: x bfloat16, the weights float32."""
    kx, k1, k2 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (shapes.batch, shapes.d), jnp.bfloat16)
    w1 = jax.random.normal(k1, (shapes.hidden, shapes.d)) * shapes.d**-0.5
    w2 = jax.random.normal(k2, (shapes.d, shapes.hidden)) * shapes.hidden**-0.5
    return x, (w1, w2)


def dense(recipe, out_sharding=None):
    """``(x, w) -> x . w^T``: BF16 casts through ``lax.dot_general`` or ``jaxmx.dot_general``."""
    if recipe is None:

        def bf16(x, w):
            x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
            return lax.dot_general(
                x, w, NT, preferred_element_type=jnp.bfloat16, out_sharding=out_sharding
            )

        return bf16
    return lambda x, w: jaxmx.dot_general(x, w, NT, recipe=recipe)


def mlp_step(dot):
    """The jitted ``(params, x) -> (loss, grads)`` of the block with ``dot``."""

    def loss(params, x):
        w1, w2 = params
        y = dot(jax.nn.gelu(dot(x, w1)), w2)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    def step(params, x):
        with jaxmx.stochastic_rounding(KEY):  # for recipes that round gradients stochastically
            return jax.value_and_grad(loss)(params, x)

    return jax.jit(step)


def _placed(mesh, shapes: Shapes, x_spec, w1_spec, w2_spec):
    x, (w1, w2) = operands(shapes)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    return put(x, x_spec), (put(w1, w1_spec), put(w2, w2_spec))


def fsdp(axis_type: AxisType):
    """FSDP on ``(8,) ("fsdp",)``: batch and the weights' first dimension over ``fsdp``."""

    def layout(recipe, shapes: Shapes) -> Case:
        mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(axis_type,))
        x, params = _placed(mesh, shapes, P("fsdp"), P("fsdp"), P("fsdp"))
        explicit = axis_type == AxisType.Explicit  # the stock dot needs the output's sharding
        out = NamedSharding(mesh, P("fsdp")) if explicit else None
        return Case(step=mlp_step(dense(recipe, out)), args=(params, x))

    return layout


def fsdp_tp(recipe, shapes: Shapes) -> Case:
    """FSDP x tensor parallel on ``(4, 2) ("fsdp", "model")``, Auto axes: ``w1 [hidden, d]``
    column parallel (rows over ``model``, columns over ``fsdp``), ``w2 [d, hidden]`` row
    parallel (columns over ``model``, rows over ``fsdp``), the batch over ``fsdp``."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "model"), axis_types=(AxisType.Auto,) * 2)
    x, params = _placed(mesh, shapes, P("fsdp"), P("model", "fsdp"), P("fsdp", "model"))
    return Case(step=mlp_step(dense(recipe)), args=(params, x))


def fsdp_shard_map(recipe, shapes: Shapes) -> Case:
    """Hand-written FSDP in ``jax.shard_map`` over ``(8,) ("fsdp",)``: each device holds its
    rows of both weights and ``jaxmx.fsdp_dot_general`` gathers them (BF16: ``lax.all_gather``
    of the bfloat16 casts, whose transpose reduce-scatters the gradient in bfloat16)."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
    x, params = _placed(mesh, shapes, P("fsdp"), P("fsdp"), P("fsdp"))

    def dot(x, w):
        if recipe is None:
            w = lax.all_gather(w.astype(jnp.bfloat16), "fsdp", axis=0, tiled=True)
            return lax.dot_general(
                x.astype(jnp.bfloat16), w, NT, preferred_element_type=jnp.bfloat16
            )
        return jaxmx.fsdp_dot_general(x, w, NT, axis_name="fsdp", gather_axis=0, recipe=recipe)

    def local_mean(y):
        return lax.psum(jnp.sum(y), "fsdp") / (shapes.batch * shapes.d)

    def loss(params, x):
        w1, w2 = params
        y = dot(jax.nn.gelu(dot(x, w1)), w2)
        return local_mean(y.astype(jnp.float32) ** 2)

    specs = ((P("fsdp"), P("fsdp")), P("fsdp"))
    sharded = jax.shard_map(loss, mesh=mesh, in_specs=specs, out_specs=P())
    return Case(step=jax.jit(jax.value_and_grad(sharded)), args=(params, x))


def moe_ep(recipe, shapes: Shapes) -> Case:
    """The expert-parallel MoE FFN's training step (``jax.grad`` with respect to the tokens and
    both expert weights), 16 experts, top-2, 1.25 x the even share of slots per expert."""
    mesh = jax.make_mesh((8,), ("expert",))
    experts, k = 16, 2
    capacity = int(shapes.batch // 8 * k / experts * 1.25)
    args = scale_moe.inputs(mesh, shapes.batch, shapes.d, shapes.hidden, experts, k)
    return Case(step=scale_moe.step(mesh, recipe, capacity), args=tuple(args))


LAYOUTS: dict[str, Callable[..., Case]] = {
    "fsdp_auto": fsdp(AxisType.Auto),
    "fsdp_explicit": fsdp(AxisType.Explicit),
    "fsdp_tp": fsdp_tp,
    "fsdp_shard_map": fsdp_shard_map,
    "moe_ep": moe_ep,
}
"""Layout name -> ``(recipe or None, Shapes) -> Case``."""


@dataclasses.dataclass(frozen=True)
class Measured:
    collectives: object  # jaxmx.diagnostics.collective_bytes of the compiled step
    temp: int
    arguments: int
    outputs: int


def measure(case: Case) -> tuple[Measured, Callable]:
    """The compiled step's collectives and memory, and the compiled step (to time)."""
    compiled = jax.jit(case.step).lower(*case.args).compile()
    m = compiled.memory_analysis()
    collectives = jaxmx.diagnostics.collective_bytes(compiled)
    sizes = m.temp_size_in_bytes, m.argument_size_in_bytes, m.output_size_in_bytes
    return Measured(collectives, *sizes), compiled


def by_dtype(collectives, kind: str) -> str:
    """``"u8 6.19 s32 12B"``: MiB per HLO dtype (bytes below 10 KiB), ``-`` for none."""
    found = sorted(collectives.by_dtype(kind).items())
    return " ".join(f"{t} {b / MIB:.2f}" if b >= 10240 else f"{t} {b}B" for t, b in found) or "-"


def _total(collectives) -> int:
    """All bytes the step's collectives move."""
    return sum(collectives.bytes.values())


def run_layout(name: str, recipes: list[str], shapes: Shapes, repeats: int) -> None:
    measured, steps, refused, args = {}, {}, {}, None
    for r in recipes:
        try:
            case = LAYOUTS[name](RECIPES[r], shapes)
            measured[r], steps[r] = measure(case)
        except (ValueError, NotImplementedError) as e:  # a recipe the layout refuses
            refused[r] = str(e).split(";")[0]
        args = args or case.args  # every recipe's step takes the same arguments
    times = interleaved_medians(steps, args, repeats)
    base = measured["bf16"]
    print(f"\n{name}  (collectives in MiB per step by dtype; ratios to bf16)")
    header = (
        f"{'recipe':>15} | {'AG':>18} | {'AR':>14} | {'RS':>14} | {'A2A':>8} | temp MiB | "
        f"args MiB | out MiB | step ms | AG x | wire x | temp x | time x"
    )
    print(header)
    print("-" * len(header))
    for r in recipes:
        if r in refused:
            print(f"{r:>15} | refused: {refused[r]}")
            continue
        m, t = measured[r], times[r].seconds
        base_ag = base.collectives.of("all-gather")
        ag = f"{m.collectives.of('all-gather') / base_ag:4.2f}" if base_ag else "   -"
        wire = _total(m.collectives) / max(_total(base.collectives), 1)
        cols = [by_dtype(m.collectives, k) for k in KINDS.values()]
        print(
            f"{r:>15} | {cols[0]:>18} | {cols[1]:>14} | {cols[2]:>14} | {cols[3]:>8} | "
            f"{m.temp / MIB:8.1f} | {m.arguments / MIB:8.1f} | {m.outputs / MIB:7.1f} | "
            f"{t * 1e3:7.0f} | {ag} | {wire:6.2f} | {m.temp / base.temp:6.2f} | "
            f"{t / times['bf16'].seconds:6.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=DEFAULT_RECIPES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    recipes = ["bf16"] + [r for r in args.recipes if r != "bf16"]
    shapes = Shapes(batch=args.batch, d=args.d, hidden=args.hidden)
    print(
        f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices "
        f"({os.cpu_count()} cores); x [{shapes.batch}, {shapes.d}] bf16, w1 [{shapes.hidden}, "
        f"{shapes.d}] and w2 [{shapes.d}, {shapes.hidden}] f32; medians of {args.repeats} "
        f"interleaved repeats; load average {os.getloadavg()[0]:.1f}"
    )
    for name in args.layouts:
        run_layout(name, recipes, shapes, args.repeats)


if __name__ == "__main__":
    main()
