"""Compile time of a training step and of the granularity advisor, against the stock step.

In one process, each timed once from a cold start (no compilation cache): the demo model's
stock bfloat16 step (``jax.jit(jax.value_and_grad(loss))`` lowered and compiled, the
baseline), the same step with MXFP8 linear layers, :func:`jaxmx.diagnostics.advise` on the
MXFP8 model (tracing, compiling and running it: what a user waits for), and the README's
MXFP8 ``einsum`` gradient beside the same gradient of ``jnp.einsum``. Times are the process's
CPU seconds (all threads; a busy machine stretches wall time, not these) and wall seconds;
ratios are of CPU time to the stock step's.

    python benchmarks/compile_time.py                        # the demo's default model
    python benchmarks/compile_time.py --d-model 32 --layers 1 --seq-len 32 --batch 8
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import jaxmx
from jaxmx.demo import advise
from jaxmx.demo.losses import loss_fn
from jaxmx.demo.train import Config, build_model, get_recipe


def timed(fn) -> tuple[float, float]:
    """``(cpu seconds, wall seconds)`` of ``fn()``."""
    cpu, wall = time.process_time(), time.perf_counter()
    jax.block_until_ready(fn())
    return time.process_time() - cpu, time.perf_counter() - wall


def compiling(fn, *args):
    """A function that lowers and compiles ``jax.jit(fn)`` for ``args`` (returns nothing)."""
    return lambda: jax.jit(fn).lower(*args).compile() and None


SIZES = ("d_model", "layers", "heads", "seq_len", "batch")
"""The demo model's size fields, each a flag of the compile benchmarks (``--d-model`` ...)."""


def add_size_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the demo's size flags (:data:`SIZES`, the demo's defaults) to ``parser``."""
    defaults = Config()
    for name in SIZES:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(defaults, name))


def sized_config(args: argparse.Namespace) -> Config:
    """The demo's :class:`Config` with the sizes of parsed :func:`add_size_flags` flags."""
    return Config(**{k: getattr(args, k) for k in SIZES})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_size_flags(parser)
    cfg = sized_config(parser.parse_args())
    x = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)
    mxfp8 = build_model(cfg, get_recipe("mxfp8"))
    step = jax.value_and_grad(loss_fn)
    rows = {
        "stock bf16 step (compile)": compiling(step, build_model(cfg), x, x),
        "MXFP8 step (compile)": compiling(step, mxfp8, x, x),
        "advise on the MXFP8 model (all)": lambda: advise.advise_model(mxfp8, cfg, 1e-3).loss,
    }
    a = jax.random.normal(jax.random.key(0), (256, 1024), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (512, 1024), jnp.float32)

    def readme(einsum):
        return compiling(jax.grad(lambda a, b: einsum("md,nd->mn", a, b).sum(), (0, 1)), a, b)

    def mx_einsum(*operands):
        return jaxmx.einsum(*operands, recipe=jaxmx.recipes.MXFP8)

    readme_rows = {
        "README gradient, jnp.einsum (compile)": readme(jnp.einsum),
        "README gradient, MXFP8 (compile)": readme(mx_einsum),
    }
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; model {cfg}")
    print(f"{'what':40s} {'cpu s':>8s} {'wall s':>8s} {'cpu ratio':>10s}")
    for group in (rows, readme_rows):
        times = {name: timed(fn) for name, fn in group.items()}
        base = next(iter(times.values()))[0]
        for name, (cpu, wall) in times.items():
            print(f"{name:40s} {cpu:8.2f} {wall:8.2f} {cpu / base:10.2f}")


if __name__ == "__main__":
    main()
