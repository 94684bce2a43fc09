"""Every demo recipe against one BF16 run: the demo's training (``jaxmx.demo.train.train``, same
seed, initial weights and batch order for every run) and its side-by-side step timing
(``jaxmx.demo.train.benchmark``), with one BF16 baseline instead of one per recipe.

Prints, as each run ends, a markdown row: final train loss (mean of the last 10% of steps) and
validation loss with their relative gaps to BF16; at the end the step-time ratios to BF16. With
``--json`` it also writes every run's losses and the ratios.

    python benchmarks/demo_ladder.py --steps 120 --json ladder.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from jaxmx.demo.config import KEEP_LAST, RECIPES, Config
from jaxmx.demo.report import relative_gap
from jaxmx.demo.train import benchmark, get_recipe, train


def row(name: str, run, baseline) -> str:
    """The markdown row of ``run`` against ``baseline``."""
    train_gap = relative_gap(run.final_train, baseline.final_train)
    val_gap = relative_gap(run.final_val, baseline.final_val)
    return (
        f"| `{name}` | {run.final_train:.4f} | {100 * train_gap:+.2f}% "
        f"| {run.final_val:.4f} | {100 * val_gap:+.2f}% |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--rounds", type=int, default=3, help="benchmark rounds")
    parser.add_argument("--bench-steps", type=int, default=4, help="steps per benchmark round")
    parser.add_argument("--json", default=None, help="file for the losses and step times")
    args = parser.parse_args()
    cfg = Config(steps=args.steps, eval_every=0)
    print(cfg, flush=True)
    baseline = train(cfg, None, name="bf16", progress=False)
    print("| recipe | train loss | gap | validation loss | gap |\n|---|---:|---:|---:|---:|")
    print(f"| `bf16` | {baseline.final_train:.4f} | | {baseline.final_val:.4f} | |", flush=True)
    runs, recipes = {"bf16": baseline}, {"bf16": None}
    for name in args.recipes:
        recipe = get_recipe(name)
        run_cfg = dataclasses.replace(cfg, keep_last=KEEP_LAST.get(name, 0))
        runs[name] = train(run_cfg, recipe, name=name, progress=False)
        recipes[name] = recipe
        print(row(name, runs[name], baseline), flush=True)
    times = benchmark(cfg, recipes, rounds=args.rounds, steps=args.bench_steps)
    for name, seconds in times.items():
        print(f"{name:>18}: step {1e3 * seconds:7.1f} ms  x{seconds / times['bf16']:.2f} bf16")
    if args.json:
        record = {
            "config": dataclasses.asdict(cfg),
            "runs": {name: run.to_dict() for name, run in runs.items()},
            "step_time": times,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
