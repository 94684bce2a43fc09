"""Flax linen MLP training step (forward + backward): jaxmx MXFP8 vs bfloat16, side by side.

A 2048-token batch through ``Dense(4096) -> gelu -> Dense(1024)`` on 1024 features, parameters
and activations in bfloat16, jitted gradient of a squared loss. Prints the median step time of
each variant over interleaved repeats (one call of each per round), its ratio to bfloat16 and
its minor page faults per step (see benchmarks/timing.py; ``--malloc pooled`` keeps freed
memory in the process).

    python benchmarks/mlp.py --repeats 15
"""

from __future__ import annotations

import argparse
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
from timing import MALLOC_CHOICES, interleaved_medians, malloc_setting, use_malloc

import jaxmx
import jaxmx.flax.linen as mxl


class MLP(nn.Module):
    hidden: int
    out: int
    recipe: jaxmx.Recipe | None

    @nn.compact
    def __call__(self, x):
        dense = {"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16, "recipe": self.recipe}
        x = mxl.Dense(self.hidden, **dense)(x)
        return mxl.Dense(self.out, **dense)(nn.gelu(x))


def train_step(model: MLP):
    def loss(params, x, y):
        return jnp.mean((model.apply(params, x).astype(jnp.float32) - y) ** 2)

    return jax.jit(jax.grad(loss))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--malloc", choices=MALLOC_CHOICES, default="default")
    args = parser.parse_args()
    use_malloc(args.malloc)
    kx, ky, kp = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (args.tokens, args.features), jnp.bfloat16)
    y = jax.random.normal(ky, (args.tokens, args.features), jnp.float32)
    variants = {"bf16": None, "mxfp8": jaxmx.recipes.MXFP8}
    steps, params = {}, None
    for name, recipe in variants.items():
        model = MLP(args.hidden, args.features, recipe)
        params = params or model.init(kp, x)  # the same parameters for every variant
        steps[name] = train_step(model)
    t = interleaved_medians(steps, (params, x, y), args.repeats)
    dev = jax.devices()[0]
    print(
        f"jax {jax.__version__}, {dev.platform} ({os.cpu_count()} cores); MLP {args.features} -> "
        f"{args.hidden} -> {args.features}, {args.tokens} tokens, fwd+bwd; medians of "
        f"{args.repeats} interleaved repeats; malloc {malloc_setting()}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    for name in steps:
        ms, ratio = t[name].seconds * 1e3, t[name].seconds / t["bf16"].seconds
        print(f"{name:>6}: {ms:8.1f} ms  {ratio:5.2f}x bf16  {t[name].faults:8.0f} faults/step")


if __name__ == "__main__":
    main()
