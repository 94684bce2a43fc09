"""Memory of a jitted training step: bfloat16 against each recipe, with and without remat.

Two models, each one jitted gradient step compiled for one device, sizes read from
``compiled.memory_analysis()`` (temporary, argument and output bytes; no run):

- ``mlp``: 4 dense layers ``1024 -> 4096 -> 1024 -> 4096 -> 1024`` with a GELU after each but
  the last (two blocks ``Dense(4096) -> GELU -> Dense(1024)``), on ``x [2048, 1024]``
  bfloat16; float32 master weights ``[in, out]`` cast to bfloat16 for each GEMM; ``jax.grad``
  of a squared loss.
- ``mlp-scan``: the same MLP with its two blocks under ``lax.scan`` (weights stacked).
- ``demo``: the demo transformer (``jaxmx.demo``, the default :class:`~jaxmx.demo.train.Config`),
  ``nnx.value_and_grad`` of its loss (no optimizer update).

Variants: the step without remat; each remat unit (an MLP block, or with ``--unit layer`` an
MLP layer; a transformer block) under ``jax.checkpoint`` with ``dots_saveable``, or for the
recipes jaxmx's 8-bit-residual policy ``save_only_these_names(jaxmx.LHS_COLWISE,
jaxmx.RHS_COLWISE)``. Ratios are to the bfloat16 step without remat, and for the remat rows
also to bfloat16 with ``dots_saveable``.

    python benchmarks/step_memory.py
    python benchmarks/step_memory.py --models mlp --unit layer --recipes MXFP8
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

import jaxmx
from jaxmx.demo.losses import cross_entropy
from jaxmx.demo.train import Config, build_model

_NT = (((1,), (0,)), ((), ()))  # h [M, K] . kernel [K, N]
DOTS = jax.checkpoint_policies.dots_saveable
EIGHT_BIT = jax.checkpoint_policies.save_only_these_names(jaxmx.LHS_COLWISE, jaxmx.RHS_COLWISE)
RECIPES = ("MXFP8", "MXFP8_2D", "FP8_TENSORWISE", "FP8_ROWWISE", "NVFP4")


def mlp_layer(w, h, recipe, last: bool):
    """One MLP layer: ``h @ w`` in bfloat16 (``w`` cast), then GELU unless ``last``."""
    w = w.astype(jnp.bfloat16)
    if recipe is None:
        h = lax.dot_general(h, w, _NT, preferred_element_type=jnp.bfloat16)
    else:
        h = jaxmx.dot_general(h, w, _NT, recipe=recipe)
    return h if last else jax.nn.gelu(h)


def mlp_step(recipe, policy, unit: str = "block"):
    """``jax.grad`` of the MLP's squared loss, each remat ``unit`` under
    ``jax.checkpoint(policy)``: a ``block`` (two layers: up, GELU, down) or a ``layer``."""
    per_unit = 2 if unit == "block" else 1

    def loss(params, x, y):
        h = x
        for start in range(0, len(params), per_unit):

            def run(ws, h, start=start):
                for i, w in enumerate(ws, start):
                    h = mlp_layer(w, h, recipe, last=i == len(params) - 1)
                return h

            ws = params[start : start + per_unit]
            h = (jax.checkpoint(run, policy=policy) if policy else run)(ws, h)
        return jnp.mean((h.astype(jnp.float32) - y) ** 2)

    return jax.grad(loss)


def scanned_mlp_step(recipe, policy):
    """:func:`mlp_step` with the two blocks' weights stacked and the blocks under ``lax.scan``
    (each step under ``jax.checkpoint(policy)``)."""

    def block(h, ws):
        h = mlp_layer(ws[0], h, recipe, last=False)
        return mlp_layer(ws[1], h, recipe, last=True), None

    body = jax.checkpoint(block, policy=policy) if policy else block

    def loss(params, x, y):
        stacked = (jnp.stack(params[0::2]), jnp.stack(params[1::2]))
        h, _ = lax.scan(body, x, stacked)
        return jnp.mean((h.astype(jnp.float32) - y) ** 2)

    return jax.grad(loss)


def mlp_args(tokens: int, features: int, hidden: int):
    dims = (features, hidden, features, hidden, features)
    keys = jax.random.split(jax.random.key(0), len(dims) + 1)
    params = [
        jax.random.normal(k, (a, b), jnp.float32) * a**-0.5
        for k, a, b in zip(keys, dims[:-1], dims[1:], strict=False)
    ]
    x = jax.random.normal(keys[-2], (tokens, features), jnp.bfloat16)
    y = jax.random.normal(keys[-1], (tokens, features), jnp.float32)
    return params, x, y


def demo_step(recipe, policy, cfg: Config):
    """The demo model's ``value_and_grad`` (functional: graph def closed over, state passed),
    each block under ``nnx.remat(policy)``."""
    graphdef, state = nnx.split(build_model(cfg, recipe))

    def loss(state, tokens, targets):
        model = nnx.merge(graphdef, state)
        x = model.embed(tokens) + model.pos_embed[...][: tokens.shape[1]].astype(model.dtype)
        for block in model.blocks:
            run = nnx.remat(lambda b, x: b(x), policy=policy) if policy else (lambda b, x: b(x))
            x = run(block, x)
        logits = model.head(model.norm(x)).astype(jnp.float32)
        return cross_entropy(logits, targets)

    return jax.value_and_grad(loss), state


def memory(fn, recipe, *args) -> tuple[int, int, int]:
    """(temp, argument, output) bytes of ``jit(fn)`` compiled for ``args`` (with a rounding key
    where ``recipe`` rounds gradients stochastically)."""
    stochastic = recipe is not None and recipe.grad_rounding == "stochastic"
    with jaxmx.stochastic_rounding(jax.random.key(1)) if stochastic else contextlib.nullcontext():
        m = jax.jit(fn).lower(*args).compile().memory_analysis()
    return m.temp_size_in_bytes, m.argument_size_in_bytes, m.output_size_in_bytes


def variants(recipes):
    """(name, recipe, policy) rows: bf16 without remat and with dots_saveable, then each recipe
    without remat, with the 8-bit-residual policy and with dots_saveable."""
    yield "bf16", None, None
    yield "bf16 dots_saveable", None, DOTS
    for name in recipes:
        r = getattr(jaxmx.recipes, name)
        yield name, r, None
        yield f"{name} 8-bit names", r, EIGHT_BIT
        yield f"{name} dots_saveable", r, DOTS


def report(title: str, sizes: dict) -> None:
    print(title)
    head = ("temp MiB", "/ bf16", "/ dots", "args MiB", "out MiB")
    print(f"{'variant':>28} " + " ".join(f"{h:>9}" for h in head))
    base, dots = sizes["bf16"][0], sizes["bf16 dots_saveable"][0]
    for name, (temp, arg, out) in sizes.items():
        remat = name.endswith("names") or name.endswith("saveable")
        vs_dots = f"{temp / dots:9.3f}" if remat else f"{'':>9}"
        print(
            f"{name:>28} {temp / 2**20:9.1f} {temp / base:9.3f} {vs_dots} "
            f"{arg / 2**20:9.1f} {out / 2**20:9.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--recipes", nargs="*", default=RECIPES)
    parser.add_argument("--models", nargs="*", default=("mlp", "mlp-scan", "demo"))
    parser.add_argument("--unit", choices=("block", "layer"), default="block")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, one device")
    if "mlp" in args.models:
        margs = mlp_args(args.tokens, args.features, args.hidden)
        steps = {n: (mlp_step(r, p, args.unit), r) for n, r, p in variants(args.recipes)}
        sizes = {n: memory(step, r, *margs) for n, (step, r) in steps.items()}
        report(
            f"mlp: 4 layers {args.features} <-> {args.hidden}, x [{args.tokens}, "
            f"{args.features}] bf16, f32 weights cast to bf16, remat per {args.unit}",
            sizes,
        )
    if "mlp-scan" in args.models:
        margs = mlp_args(args.tokens, args.features, args.hidden)
        steps = {n: (scanned_mlp_step(r, p), r) for n, r, p in variants(args.recipes)}
        sizes = {n: memory(step, r, *margs) for n, (step, r) in steps.items()}
        report(
            "mlp-scan: the same MLP, its 2 blocks under lax.scan (stacked weights), remat "
            "per block",
            sizes,
        )
    if "demo" in args.models:
        cfg = Config()
        tokens = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)
        sizes = {}
        for n, r, p in variants(args.recipes):
            step, state = demo_step(r, p, cfg)
            sizes[n] = memory(step, r, state, tokens, tokens)
        report(
            f"demo: d_model {cfg.d_model}, {cfg.layers} blocks, batch {cfg.batch} x "
            f"{cfg.seq_len}, remat per block",
            sizes,
        )


if __name__ == "__main__":
    main()
