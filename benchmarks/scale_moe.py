"""Expert-parallel MoE training step on 8 CPU devices: the dispatch in bfloat16 vs in 8 bits.

``jaxmx.expert_parallel_ffn`` inside ``jax.shard_map`` over an 8-device ``expert`` axis (the
tokens and the experts sharded over it), ``jax.grad`` of a squared loss with respect to the
tokens and both expert weights, bfloat16 tokens and weights. Two variants of the same layer:

- ``bf16``: ``recipe=None``: the tokens travel in bfloat16 and the experts run the stock
  ``lax.ragged_dot``;
- ``mxfp8``: ``recipe=jaxmx.recipes.MXFP8``: the tokens travel as MXFP8 codes and E8M0 scales
  (``uint8``), the experts run ``jaxmx.ragged_dot`` (emulated on the CPU).

For each it prints, from the compiled step: the all-to-all bytes per device by HLO dtype
(XLA:CPU widens bfloat16 collectives to float32, so bfloat16 shows as ``f32``), the other
collectives, ``memory_analysis()`` (temporaries, arguments, outputs) and the median step time
over interleaved repeats, with the ratios to ``bf16`` measured in the same run.

    python benchmarks/scale_moe.py --repeats 5
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from timing import interleaved_medians

import jaxmx
from jaxmx.diagnostics import COLLECTIVES, collective_bytes

MIB = 2**20


def step(mesh, recipe, capacity: int):
    """The jitted gradient of a squared loss through the layer."""

    def ffn(*a):
        return jaxmx.expert_parallel_ffn(*a, axis_name="expert", capacity=capacity, recipe=recipe)

    layer = jax.shard_map(ffn, mesh=mesh, in_specs=P("expert"), out_specs=(P("expert"), P()))

    def loss(x, w_in, w_out, ids, gates):
        y, _ = layer(x, ids, gates, w_in, w_out)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def inputs(mesh, tokens: int, d: int, h: int, experts: int, k: int):
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (tokens, d), jnp.bfloat16)
    w_in = (jax.random.normal(ks[1], (experts, d, h)) * d**-0.5).astype(jnp.bfloat16)
    w_out = (jax.random.normal(ks[2], (experts, h, d)) * h**-0.5).astype(jnp.bfloat16)
    ids = jax.random.randint(ks[3], (tokens, k), 0, experts)
    gates = jax.nn.softmax(jax.random.normal(ks[4], (tokens, k)))
    sharding = NamedSharding(mesh, P("expert"))
    return [jax.device_put(a, sharding) for a in (x, w_in, w_out, ids, gates)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="over all 8 devices")
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--h", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16, help="over all 8 devices")
    parser.add_argument("--k", type=int, default=2, help="experts per token")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--repeats", type=int, default=5)
    a = parser.parse_args()
    mesh = jax.make_mesh((8,), ("expert",))
    # slots per expert on each device: the device's assignments over the experts, times the factor
    capacity = int(a.tokens // 8 * a.k / a.experts * a.capacity_factor)
    args = inputs(mesh, a.tokens, a.d, a.h, a.experts, a.k)
    rows = a.experts * capacity  # rows each device sends in the dispatch
    print(
        f"8 devices, {a.tokens} tokens x {a.d}, {a.experts} experts [{a.d}, {a.h}] / [{a.h}, "
        f"{a.d}], top-{a.k}, capacity {capacity} per expert per device: {rows} x {a.d} = "
        f"{rows * a.d} dispatched elements per device"
    )
    variants = {"bf16": None, "mxfp8": jaxmx.recipes.MXFP8}
    fns, stats = {}, {}
    for name, recipe in variants.items():
        fn = step(mesh, recipe, capacity)
        compiled = fn.lower(*args).compile()
        fns[name] = compiled
        stats[name] = (collective_bytes(compiled), compiled.memory_analysis())
    times = interleaved_medians(fns, args, repeats=a.repeats)
    base = stats["bf16"]
    print("\nper training step, per device:")
    for name in variants:
        moved, memory = stats[name]
        a2a = moved.by_dtype("all-to-all")
        a2a_text = ", ".join(f"{d} {n / MIB:.2f} MiB" for d, n in a2a.items())
        print(
            f"{name:>6}: all-to-all {a2a_text} (total {moved.of('all-to-all') / MIB:.2f} MiB, "
            f"{moved.of('all-to-all') / base[0].of('all-to-all'):.2f}x bf16)"
        )
        if "u8" in a2a:
            print(f"        dispatch: {a2a['u8'] / (rows * a.d):.4f} bytes per dispatched element")
        others = {
            f"{kind} {d}": n
            for kind in COLLECTIVES
            if kind != "all-to-all"
            for d, n in moved.by_dtype(kind).items()
        }
        print(
            "        other collectives: "
            + (", ".join(f"{k} {n} B" for k, n in others.items()) or "none")
        )
        print(
            f"        memory: temp {memory.temp_size_in_bytes / MIB:.1f} MiB "
            f"({memory.temp_size_in_bytes / base[1].temp_size_in_bytes:.2f}x bf16), "
            f"arguments {memory.argument_size_in_bytes / MIB:.1f} MiB, "
            f"outputs {memory.output_size_in_bytes / MIB:.1f} MiB"
        )
        t = times[name].seconds
        print(
            f"        step {t * 1e3:.1f} ms ({t / times['bf16'].seconds:.2f}x bf16), median of "
            f"{a.repeats}"
        )


if __name__ == "__main__":
    main()
