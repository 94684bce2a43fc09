"""Compile cost of the demo model's training step for every recipe, against the stock step.

For the stock bfloat16 step and each recipe of ``jaxmx.demo.train.RECIPES`` (each measured
cold: ``jax.clear_caches()`` before it, a fresh ``jax.value_and_grad``), it times tracing and
lowering (``jax.jit(step).lower``: what jaxmx hands XLA) and XLA's compilation, in the
process's CPU seconds (all threads; a busy machine stretches wall time, not these), and counts
the operations of the lowered StableHLO module and the instructions of the compiled HLO. Every
column but the counts is a ratio to the stock step's, measured in the same run; ``rounds``
repeats the whole table and keeps each row's smallest CPU time.

    python benchmarks/compile_recipes.py                      # the demo's default model
    python benchmarks/compile_recipes.py --recipes mxfp8,nvfp4 --rounds 3
    python benchmarks/compile_recipes.py --recipes mxfp8 --exact-emulation   # + "mxfp8 exact"

``--exact-emulation`` adds, for each recipe that takes it, a row with
``Recipe.exact_emulation=True`` (the training GEMMs' exact path).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from compile_time import add_size_flags, sized_config

from jaxmx.demo.losses import loss_fn, rounding
from jaxmx.demo.train import RECIPES, Config, build_model, get_recipe


def operations(text: str) -> int:
    """The number of operations (lines that define a value) of a StableHLO or HLO text."""
    return sum(" = " in line for line in text.splitlines())


def measure(cfg: Config, recipe) -> dict:
    """Cold CPU seconds of lowering and of compiling one training step, and its op counts."""
    jax.clear_caches()
    x = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)
    model = build_model(cfg, recipe)
    key = jax.random.key(0)

    def step(model, inputs, targets, key):
        with rounding(key if _stochastic(recipe) else None):
            return jax.value_and_grad(loss_fn)(model, inputs, targets)

    start = time.process_time()
    lowered = jax.jit(step).lower(model, x, x, key)
    lowering = time.process_time() - start
    start = time.process_time()
    compiled = lowered.compile()
    compiling = time.process_time() - start
    return {
        "lower": lowering,
        "compile": compiling,
        "stablehlo": operations(lowered.as_text()),
        "hlo": operations(compiled.as_text()),
    }


def _exact_variants(recipes: dict) -> dict:
    """``"<name> exact"``: each recipe with ``exact_emulation=True``, where it takes it."""
    variants = {}
    for name, recipe in recipes.items():
        if recipe is None:  # the stock step
            continue
        try:
            variants[f"{name} exact"] = recipe.replace(exact_emulation=True)
        except ValueError as refusal:  # e.g. a recipe without E8M0 scales
            print(f"no '{name} exact' row: {refusal}")
    return variants


def _stochastic(recipe) -> bool:
    return recipe is not None and recipe.grad_rounding == "stochastic"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--exact-emulation", action="store_true")
    add_size_flags(parser)
    args = parser.parse_args()
    cfg = sized_config(args)
    names = ["stock bf16", *args.recipes.split(",")]
    recipes = {n: None if n == "stock bf16" else get_recipe(n) for n in names}
    if args.exact_emulation:
        recipes.update(_exact_variants(recipes))
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name, recipe in recipes.items():
            m = measure(cfg, recipe)
            total = m["lower"] + m["compile"]
            if name not in best or total < best[name]["lower"] + best[name]["compile"]:
                best[name] = m
    base = best["stock bf16"]
    base_total = base["lower"] + base["compile"]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; model {cfg}")
    head = ("recipe", "lower s", "compile s", "total ratio", "lower", "compile", "stablehlo", "hlo")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, m in best.items():
        row = (
            name,
            f"{m['lower']:.2f}",
            f"{m['compile']:.2f}",
            f"{(m['lower'] + m['compile']) / base_total:.2f}",
            f"{m['lower'] / base['lower']:.1f}",
            f"{m['compile'] / base['compile']:.2f}",
            f"{m['stablehlo']} ({m['stablehlo'] / base['stablehlo']:.1f}x)",
            f"{m['hlo']} ({m['hlo'] / base['hlo']:.1f}x)",
        )
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
