"""Activations saved in low precision (``jaxmx.save_quantized``) on the demo transformer: the
training step's memory and the loss, each against the same model keeping its activations as
autodiff does, measured in the same run.

- memory: ``compiled.memory_analysis().temp_size_in_bytes`` of the jitted
  ``jax.value_and_grad`` of the demo's loss (the default :class:`~jaxmx.demo.train.Config`, or
  the sizes given), compiled for one device (no run), per ``--save-activations`` format, in
  BF16 and with the MXFP8 recipe, the blocks unrolled and under ``lax.scan``; ratios to the
  same recipe with ``none``; ``none, remat``: each scanned block under ``jax.checkpoint``
  instead (its bf16 input saved, everything recomputed);
- loss (``--steps N``, 0 to skip): the demo trained N steps in BF16 per format, from the same
  seed and data order; final validation loss and its relative gap to ``none``. docs/demo.md
  gives the BF16 seed band at 600 steps.

    python benchmarks/activation_storage.py
    python benchmarks/activation_storage.py --steps 600 --formats mxfp8_e4m3 e5m6_block
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

import jaxmx
from jaxmx.demo.losses import cross_entropy, loss_fn
from jaxmx.demo.train import Config, build_model, train


def step_temp_bytes(cfg: Config, recipe, scan: bool, remat: bool = False) -> int:
    """Temporary bytes of the compiled gradient step of the demo model built from ``cfg``; with
    ``scan``, its blocks run under ``lax.scan`` (their parameters stacked), and with ``remat``
    each block under ``jax.checkpoint`` (nothing saved but its input)."""
    model = build_model(cfg, recipe)
    tokens = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)
    if not scan:
        graphdef, state = nnx.split(model)

        def loss(state, tokens, targets):
            return loss_fn(nnx.merge(graphdef, state), tokens, targets)

    else:
        outer_def, outer = nnx.split((model.embed, model.pos_embed, model.norm, model.head))
        block_def = nnx.graphdef(model.blocks[0])
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *(nnx.state(b) for b in model.blocks))
        state = (outer, stacked)

        def loss(state, tokens, targets):
            embed, pos, norm, head = nnx.merge(outer_def, state[0])
            x = embed(tokens) + pos[...][: tokens.shape[1]].astype(model.dtype)
            body = lambda x, s: (nnx.merge(block_def, s)(x), None)
            x, _ = lax.scan(jax.checkpoint(body) if remat else body, x, state[1])
            return cross_entropy(head(norm(x)).astype(jnp.float32), targets)

    lowered = jax.jit(jax.value_and_grad(loss)).lower(state, tokens, tokens)
    return lowered.compile().memory_analysis().temp_size_in_bytes


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=list(jaxmx.SAVE_FORMATS))
    p.add_argument("--steps", type=int, default=0, help="training steps per loss run; 0: none")
    p.add_argument("--no-memory", action="store_true", help="skip the step-memory table")
    p.add_argument("--d-model", type=int, default=Config.d_model)
    p.add_argument("--layers", type=int, default=Config.layers)
    p.add_argument("--seq-len", type=int, default=Config.seq_len)
    p.add_argument("--batch", type=int, default=Config.batch)
    args = p.parse_args(argv)
    base = Config(d_model=args.d_model, layers=args.layers, seq_len=args.seq_len, batch=args.batch)
    if args.steps:
        base = dataclasses.replace(base, steps=args.steps)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {base}")
    fmts = [None, *args.formats]
    if not args.no_memory:
        memory_table(base, fmts)
    if not args.steps:
        return
    print(f"\nloss after {base.steps} steps (BF16 GEMMs, same seed and batches)")
    print(f"{'saved in':16} {'val loss':>9} {'vs none':>9}")
    ref = None
    for fmt in fmts:
        cfg = dataclasses.replace(base, save_activations=fmt)
        val = train(cfg, None, name=fmt or "none", progress=False).final_val
        ref = ref or val
        print(f"{fmt or 'none':16} {val:9.4f} {val / ref - 1:+9.2%}", flush=True)


def memory_table(base: Config, fmts) -> None:
    """Prints the step-memory rows of each format, unrolled and scanned, BF16 and MXFP8."""
    print("\nstep memory (temporary bytes of the compiled value_and_grad, XLA:CPU)")
    print(f"{'blocks':9} {'recipe':6} {'saved in':16} {'temp MiB':>9} {'vs none':>8}")
    for scan in (False, True):
        for rname, recipe in (("bf16", None), ("mxfp8", jaxmx.recipes.MXFP8)):
            ref = None
            for fmt in fmts:
                cfg = dataclasses.replace(base, save_activations=fmt)
                temp = step_temp_bytes(cfg, recipe, scan)
                ref = ref or temp
                where = "scanned" if scan else "unrolled"
                print(
                    f"{where:9} {rname:6} {fmt or 'none':16} {temp / 2**20:9.2f} {temp / ref:8.3f}",
                    flush=True,
                )
            if scan:
                temp = step_temp_bytes(base, recipe, scan, remat=True)
                print(
                    f"{'scanned':9} {rname:6} {'none, remat':16} {temp / 2**20:9.2f} "
                    f"{temp / ref:8.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
