"""Memory of a jitted training step: bfloat16 against each recipe, in every setup.

Two models, each one jitted gradient step compiled for one device, sizes read from
``compiled.memory_analysis()`` (temporary, argument and output bytes; no run):

- ``mlp``: 4 dense layers ``1024 -> 4096 -> 1024 -> 4096 -> 1024`` with a GELU after each but
  the last (two blocks ``Dense(4096) -> GELU -> Dense(1024)``), on ``x [2048, 1024]``
  bfloat16; float32 master weights ``[in, out]``; ``jax.grad`` of a squared loss. The blocks
  unrolled, or with ``--loop scan`` under ``lax.scan`` (weights stacked).
- ``demo``: the demo transformer (``jaxmx.demo``, the default :class:`~jaxmx.demo.train.Config`),
  ``nnx.value_and_grad`` of its loss (no optimizer update).

Setups of the MLP: ``--masters cast``: each float32 master cast to bfloat16 before the GEMM
(the bf16 baseline always does that), ``--masters f32``: the float32 master passed to
``jaxmx.dot_general`` as it is (the recipe quantizes it; the output is bfloat16). Remat: none;
each remat unit (an MLP block, or with ``--unit layer`` an MLP layer; a transformer block)
under ``jax.checkpoint`` with ``dots_saveable`` ("dots"), or for the recipes jaxmx's
8-bit-residual policy ``save_only_these_names(jaxmx.LHS_COLWISE, jaxmx.RHS_COLWISE)``
("8-bit names"). Ratios are to the bfloat16 step without remat, and for the remat rows also to
bfloat16 with ``dots_saveable``.

    python benchmarks/step_memory.py
    python benchmarks/step_memory.py --models mlp --loop scan --masters f32 --recipes NVFP4
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
POLICIES = {"none": None, "dots": DOTS, "8-bit names": EIGHT_BIT}
MASTERS = {"cast": "cast to bf16", "f32": "passed as f32"}
RECIPES = ("MXFP8", "MXFP8_2D", "FP8_TENSORWISE", "FP8_ROWWISE", "DEEPSEEK_FP8", "NVFP4")


def mlp_layer(w, h, recipe, last: bool, masters: str = "cast"):
    """One MLP layer: ``h @ w`` with a bfloat16 result (``w`` cast to bfloat16 first, or with
    ``masters="f32"`` and a recipe, passed as it is), then GELU unless ``last``."""
    if recipe is None or masters == "cast":
        w = w.astype(jnp.bfloat16)
    if recipe is None:
        h = lax.dot_general(h, w, _NT, preferred_element_type=jnp.bfloat16)
    else:
        h = jaxmx.dot_general(h, w, _NT, recipe=recipe, preferred_element_type=jnp.bfloat16)
    return h if last else jax.nn.gelu(h)


def mlp_step(recipe, policy, unit: str = "block", masters: str = "cast"):
    """``jax.grad`` of the MLP's squared loss, each remat ``unit`` under
    ``jax.checkpoint(policy)``: a ``block`` (two layers: up, GELU, down) or a ``layer``."""
    per_unit = 2 if unit == "block" else 1

    def loss(params, x, y):
        h = x
        for start in range(0, len(params), per_unit):

            def run(ws, h, start=start):
                for i, w in enumerate(ws, start):
                    h = mlp_layer(w, h, recipe, i == len(params) - 1, masters)
                return h

            ws = params[start : start + per_unit]
            h = (jax.checkpoint(run, policy=policy) if policy else run)(ws, h)
        return jnp.mean((h.astype(jnp.float32) - y) ** 2)

    return jax.grad(loss)


def scanned_mlp_step(recipe, policy, masters: str = "cast"):
    """:func:`mlp_step` with the two blocks' weights stacked and the blocks under ``lax.scan``
    (each step under ``jax.checkpoint(policy)``)."""

    def block(h, ws):
        h = mlp_layer(ws[0], h, recipe, False, masters)
        return mlp_layer(ws[1], h, recipe, True, masters), None

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


def variants(recipes, policies):
    """(name, recipe, policy) rows: bf16 without remat and with dots_saveable, then each recipe
    with each of ``policies``."""
    yield "bf16", None, None
    yield "bf16 dots", None, DOTS
    for name in recipes:
        r = getattr(jaxmx.recipes, name)
        for p in policies:
            yield name if p == "none" else f"{name} {p}", r, POLICIES[p]


def report(title: str, sizes: dict) -> None:
    print(title)
    head = ("temp MiB", "/ bf16", "/ dots", "args MiB", "out MiB")
    print(f"{'variant':>28} " + " ".join(f"{h:>9}" for h in head))
    base, dots = sizes["bf16"][0], sizes["bf16 dots"][0]
    for name, (temp, arg, out) in sizes.items():
        remat = name.endswith("names") or name.endswith("dots")
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
    parser.add_argument("--models", nargs="*", choices=("mlp", "demo"), default=("mlp", "demo"))
    parser.add_argument(
        "--loop", nargs="*", choices=("unrolled", "scan"), default=("unrolled", "scan")
    )
    parser.add_argument("--masters", nargs="*", choices=("cast", "f32"), default=("cast", "f32"))
    parser.add_argument("--remat", nargs="*", choices=tuple(POLICIES), default=tuple(POLICIES))
    parser.add_argument("--unit", choices=("block", "layer"), default="block")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, one device")
    if "mlp" in args.models:
        margs = mlp_args(args.tokens, args.features, args.hidden)
        for loop in args.loop:
            for masters in args.masters:
                sizes = {}
                for n, r, p in variants(args.recipes, args.remat):
                    if loop == "scan":
                        step = scanned_mlp_step(r, p, masters)
                    else:
                        step = mlp_step(r, p, args.unit, masters)
                    sizes[n] = memory(step, r, *margs)
                report(
                    f"mlp {loop}: 4 layers {args.features} <-> {args.hidden}, x [{args.tokens}, "
                    f"{args.features}] bf16, f32 masters {MASTERS[masters]}, "
                    f"remat per {'block' if loop == 'scan' else args.unit}",
                    sizes,
                )
    if "demo" in args.models:
        cfg = Config()
        tokens = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)
        sizes = {}
        for n, r, p in variants(args.recipes, args.remat):
            step, state = demo_step(r, p, cfg)
            sizes[n] = memory(step, r, state, tokens, tokens)
        report(
            f"demo: d_model {cfg.d_model}, {cfg.layers} blocks, batch {cfg.batch} x "
            f"{cfg.seq_len}, remat per block",
            sizes,
        )


if __name__ == "__main__":
    main()
