"""The demo model trained with each optimizer-state format of ``jaxmx.optim`` against float32 Adam.

Every run trains the demo transformer (``jaxmx.demo``, BF16, the default
:class:`~jaxmx.demo.train.Config` unless ``--steps`` says otherwise) from the same seed on the
same batches, with the demo's optimizer (clipping at 1, AdamW b1 0.9, b2 0.95, weight decay 0.1,
warmup and cosine decay): ``optax`` is ``optax.adamw`` (float32 moments, the baseline); each
format is ``jaxmx.optim.adamw(..., state_format=fmt)``. It prints, per run, the final validation
loss and its gap to the baseline's, the mean training loss of the last 50 steps, and the
optimizer state's device bytes (``jaxmx.optim.state_bytes``) as a ratio to the baseline's.

    python benchmarks/optimizer_states.py
    python benchmarks/optimizer_states.py --steps 100 --eval-batches 20 --formats 8bit 4bit
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxmx.optim
from jaxmx.demo import data
from jaxmx.demo.train import Config, build_model, evaluate, train_step

FORMATS = ("float32", "bfloat16", "8bit", "fp8", "4bit")


def transform(cfg: Config, fmt: str | None) -> optax.GradientTransformation:
    """The demo's optimizer; its AdamW from optax (``fmt=None``) or jaxmx.optim in ``fmt``."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1), end_value=cfg.lr / 10
    )
    kwargs = dict(b1=0.9, b2=0.95, weight_decay=cfg.weight_decay)
    adamw = (
        optax.adamw(schedule, **kwargs)
        if fmt is None
        else jaxmx.optim.adamw(schedule, **kwargs, state_format=fmt)
    )
    return optax.chain(optax.clip_by_global_norm(1.0), adamw)


def run(cfg: Config, fmt: str | None, train_data, val_batches) -> dict:
    model = build_model(cfg)
    optimizer = nnx.Optimizer(model, transform(cfg, fmt), wrt=nnx.Param)
    batches = data.batches(train_data, cfg.batch, cfg.seq_len, seed=cfg.seed)
    start, losses = time.perf_counter(), []
    for _ in range(cfg.steps):
        x, y = (jnp.asarray(a) for a in next(batches))
        losses.append(float(train_step(model, optimizer, x, y)))
    return {
        "val": evaluate(model, val_batches),
        "train": float(np.mean(losses[-50:])),
        "bytes": jaxmx.optim.state_bytes(optimizer.opt_state),
        "fallbacks": len(jaxmx.optim.state_report(optimizer.opt_state).fallbacks) // 2,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=Config().steps)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--eval-batches", type=int, default=None, help="validation batches (default: the split)"
    )
    args = p.parse_args()
    cfg = dataclasses.replace(
        Config(), steps=args.steps, seed=args.seed, eval_batches=args.eval_batches
    )
    train_data, val_data = data.load_splits()
    val_batches = data.eval_batches(val_data, cfg.batch, cfg.seq_len, cfg.eval_batches)
    base = run(cfg, None, train_data, val_batches)
    print(f"demo model, {cfg.steps} steps, seed {cfg.seed}; optax = optax.adamw (float32 moments)")
    header = f"{'state':>9s} {'val loss':>9s} {'vs optax':>9s} {'train loss':>10s}"
    print(f"{header} {'state bytes':>12s} {'x optax':>8s} {'f32 params':>10s} {'s':>5s}")
    for fmt in [None, *args.formats]:
        r = base if fmt is None else run(cfg, fmt, train_data, val_batches)
        gap = r["val"] / base["val"] - 1
        print(
            f"{fmt or 'optax':>9s} {r['val']:9.4f} {gap:+9.2%} {r['train']:10.4f} "
            f"{r['bytes']:12d} {r['bytes'] / base['bytes']:8.3f} {r['fallbacks']:10d} "
            f"{r['seconds']:5.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
