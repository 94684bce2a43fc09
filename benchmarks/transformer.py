"""Training-step time of the demo transformer: MXFP8 (attention products off / on) vs BF16.

The demo model (``jaxmx.demo``: a byte-level transformer), one jitted AdamW step on one batch,
timed side by side: each round times ``--steps`` steps of every variant in turn, and each
variant keeps its fastest round. Prints seconds per step and the ratio to the BF16 step
measured in the same run.

    python benchmarks/transformer.py --rounds 5 --steps 8
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from jaxmx.demo import data
from jaxmx.demo.train import Config, build_model, get_recipe, make_optimizer, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=Config.d_model)
    parser.add_argument("--seq-len", type=int, default=Config.seq_len)
    parser.add_argument("--batch", type=int, default=Config.batch)
    args = parser.parse_args()
    cfg = Config(d_model=args.d_model, seq_len=args.seq_len, batch=args.batch)
    mx = get_recipe("mxfp8")
    variants = {
        "bf16": (None, False),
        "mxfp8": (mx, False),
        "mxfp8 + attention": (mx, True),
    }
    x, y = (
        jnp.asarray(a)
        for a in next(data.batches(data.load_splits()[0], cfg.batch, cfg.seq_len, cfg.seed))
    )
    states = {}
    for name, (recipe, attention) in variants.items():
        model = build_model(cfg, recipe, attention=attention)
        optimizer = make_optimizer(cfg, model)
        train_step(model, optimizer, x, y).block_until_ready()  # compile
        states[name] = (model, optimizer)
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.rounds):
        for name, (model, optimizer) in states.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                loss = train_step(model, optimizer, x, y)
            loss.block_until_ready()
            best[name] = min(best[name], (time.perf_counter() - start) / args.steps)
    print(
        f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; d_model {cfg.d_model}, "
        f"{cfg.layers} layers, batch {cfg.batch} x {cfg.seq_len} tokens"
    )
    print(f"{'variant':>18} {'ms/step':>9} {'/ bf16':>7}")
    for name, seconds in best.items():
        print(f"{name:>18} {seconds * 1e3:9.1f} {seconds / best['bf16']:7.2f}")


if __name__ == "__main__":
    main()
