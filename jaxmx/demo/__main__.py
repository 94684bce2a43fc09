"""``python -m jaxmx.demo``: the same small transformer trained in BF16 and in MXFP8, compared.

Both runs start from the same initial weights and see the same batches in the same order. The MXFP8
run sends every linear layer of the blocks through ``jaxmx.dot_general`` (forward, dgrad and wgrad
on MX operands); embeddings, the output head, norms and attention scores stay in BF16. At the end
it prints a table of train/validation losses with the relative gap and the step-time ratio, and
writes ``loss_curves.png``, ``summary.txt`` and ``history.json`` to ``--out``. ``--recipe nvfp4``
(or ``mxfp4``) trains in 4 bits, by default with the last block in BF16 (``--keep-last``);
``--ablate`` also trains it with each of its features switched off in turn. ``--advise`` measures
which scaling granularity each GEMM leg needs after the MXFP8 run, and trains with the advised
per-layer recipes beside it. The trained BF16 model is saved (orbax) to ``--out``/bf16_model,
from which ``python -m jaxmx.demo generate`` decodes.
"""

from __future__ import annotations

import argparse
import sys

import jax

from jaxmx import BACKENDS, FORMATS, SAVE_FORMATS
from jaxmx.demo import advise, report, serve
from jaxmx.demo.train import (
    KEEP_LAST,
    RECIPES,
    Config,
    ablate,
    compare,
    get_recipe,
    seed_band,
    train,
)

_DEFAULTS = Config()


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line; ``--help`` shows every flag with its default."""
    p = argparse.ArgumentParser(
        prog="python -m jaxmx.demo",
        description=__doc__.split("\n")[0].replace("``", ""),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="python -m jaxmx.demo generate --help: decode from the trained BF16 model",
    )
    p.add_argument("--steps", type=int, default=_DEFAULTS.steps, help="training steps per run")
    p.add_argument("--d-model", type=int, default=_DEFAULTS.d_model, help="model width")
    p.add_argument("--layers", type=int, default=_DEFAULTS.layers, help="transformer blocks")
    p.add_argument("--heads", type=int, default=_DEFAULTS.heads, help="attention heads")
    p.add_argument("--seq-len", type=int, default=_DEFAULTS.seq_len, help="context length in bytes")
    p.add_argument("--batch", type=int, default=_DEFAULTS.batch, help="sequences per batch")
    p.add_argument("--lr", type=float, default=_DEFAULTS.lr, help="peak learning rate")
    p.add_argument(
        "--seed", type=int, default=_DEFAULTS.seed, help="seed of the weights and the batch order"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=_DEFAULTS.eval_every,
        help="steps between validations; 0: only at the end",
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=None,
        help="batches per validation; None: the whole validation split",
    )
    p.add_argument("--recipe", choices=RECIPES, default="mxfp8", help="the quantized run's recipe")
    p.add_argument(
        "--save-activations",
        choices=("none", *SAVE_FORMATS),
        default="none",
        help="keep each block's saved inputs (norms, attention output, GELU) in this format for "
        "the backward pass (jaxmx.save_quantized), in both compared runs; the --seeds band "
        "stays plain BF16",
    )
    p.add_argument(
        "--keep-last",
        type=int,
        default=None,
        help="the last blocks whose linear layers stay in BF16; None: 1 for nvfp4 and mxfp4, "
        "else 0",
    )
    p.add_argument(
        "--ablate",
        action="store_true",
        help="train BF16, the recipe, and the recipe with each of its features (random Hadamard "
        "transform, 2-D weight tiles, stochastic rounding, --keep-last) off in turn; tabulate "
        "the validation-loss gaps to BF16",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="jaxmx GEMM backend; None: the recipe's (auto: cuBLASLt where supported, else "
        "exact emulation)",
    )
    p.add_argument(
        "--diagnose",
        action="store_true",
        help="record per-GEMM quantization telemetry in the MX run and plot it (layer x step)",
    )
    p.add_argument(
        "--diagnose-every",
        type=int,
        default=None,
        help="steps between telemetry records; None: steps / 30",
    )
    p.add_argument(
        "--advise",
        action="store_true",
        help="train MXFP8, print and plot the scaling granularity each GEMM leg needs "
        "(jaxmx.diagnostics.advise), then train with the advised per-layer recipes and compare "
        "the final losses",
    )
    p.add_argument(
        "--advise-budget",
        type=float,
        default=1e-3,
        help="--advise: the underflow fraction a scaling level may leave",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=0,
        help="rerun BF16 with this many other seeds; report whether the MX run lies in the band",
    )
    p.add_argument(
        "--out", default="jaxmx_demo", help="output directory of the plot and the summary"
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress output (a bar on a terminal, else plain lines)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_generate_parser() -> argparse.ArgumentParser:
    """``python -m jaxmx.demo generate``'s command line."""
    p = argparse.ArgumentParser(
        prog="python -m jaxmx.demo generate",
        description="Greedy decoding from the BF16 model a training run saved in --out: with "
        "bf16 weights and KV cache, then with MX weights at rest and an MX KV cache; compares "
        "the texts, the validation log-likelihood, the bytes and the speed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--out", default="jaxmx_demo", help="the training run's output directory (the model)"
    )
    p.add_argument("--prompt", default="The ", help="the prompt (UTF-8)")
    p.add_argument(
        "--length",
        type=int,
        default=None,
        help="bytes to generate; None: up to the model's context (--seq-len of the training)",
    )
    p.add_argument(
        "--weights-fmt",
        choices=[n for n, f in FORMATS.items() if f.gemm_operand],
        default="mxfp8_e4m3",
        help="format of the linear layers' weights at rest (weight-only)",
    )
    p.add_argument(
        "--cache-fmt",
        choices=[n for n, f in FORMATS.items() if f.gemm_operand],
        default="mxfp8_e4m3",
        help="format of the MX KV cache",
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=4,
        help="validation batches (of the training's --batch windows) for the log-likelihood; "
        "0: the whole validation split",
    )
    return p


def cache_note(d_model: int, heads: int) -> str | None:
    """What ``generate`` will refuse for a model of this shape, said before training it: the KV
    cache quantizes along ``head_dim = d_model // heads``, which must be a multiple of the cache
    format's block (32 for the default ``--cache-fmt mxfp8_e4m3``); ``None`` when it is.

    Example:
        >>> print(cache_note(64, 4))                       # doctest: +NORMALIZE_WHITESPACE
        note: head_dim 16 (--d-model 64 / --heads 4) is not a multiple of 32: `generate` will
        refuse its default --cache-fmt mxfp8_e4m3 and the other 32-blocked formats (nvfp4 fits;
        --heads 2 gives head_dim 32)
    """
    head_dim = d_model // heads
    block = FORMATS["mxfp8_e4m3"].block
    if head_dim % block == 0:
        return None
    fits = sorted(
        n
        for n, f in FORMATS.items()
        if f.span == "block" and f.gemm_operand and head_dim % f.block == 0
    )
    hint = [f"{' / '.join(fits)} fits"] if fits else []
    if d_model % block == 0:
        h = max(h for h in range(1, d_model // block + 1) if d_model % (block * h) == 0)
        hint.append(f"--heads {h} gives head_dim {d_model // h}")
    return (
        f"note: head_dim {head_dim} (--d-model {d_model} / --heads {heads}) is not a multiple of "
        f"{block}: `generate` will refuse its default --cache-fmt mxfp8_e4m3 and the other "
        f"{block}-blocked formats" + (f" ({'; '.join(hint)})" if hint else "")
    )


def generate(argv: list[str]) -> int:
    """``python -m jaxmx.demo generate ...``: prints :func:`jaxmx.demo.serve.serve`'s report."""
    args = build_generate_parser().parse_args(argv)
    try:
        model, cfg = serve.load_model(args.out)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(f"restored the bf16 model of {cfg}")
    try:
        result = serve.serve(
            model,
            prompt=args.prompt.encode("utf-8"),
            length=args.length,
            weights_fmt=args.weights_fmt,
            cache_fmt=args.cache_fmt,
            batch=cfg.batch,
            eval_batches=args.eval_batches or None,
        )
    except ValueError as e:
        raise SystemExit(f"generate: {e}") from None
    print(result)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["generate"]:
        return generate(argv[1:])
    args = parse_args(argv)
    keep_last = KEEP_LAST.get(args.recipe, 0) if args.keep_last is None else args.keep_last
    if not 0 <= keep_last <= args.layers:
        raise SystemExit(f"--keep-last must be in 0 .. --layers ({args.layers}), got {keep_last}")
    cfg = Config(
        steps=args.steps,
        d_model=args.d_model,
        layers=args.layers,
        heads=args.heads,
        seq_len=args.seq_len,
        batch=args.batch,
        lr=args.lr,
        seed=args.seed,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        keep_last=keep_last,
        save_activations=None if args.save_activations == "none" else args.save_activations,
    )
    recipe = get_recipe(args.recipe, args.backend)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(f"{cfg}\n{recipe}")
    if note := cache_note(cfg.d_model, cfg.heads):
        print(note)
    if args.seeds < 0 or (args.diagnose_every is not None and args.diagnose_every < 1):
        raise SystemExit("--seeds must be >= 0 and --diagnose-every >= 1")
    if args.ablate and (args.diagnose or args.seeds):
        raise SystemExit("--ablate does not combine with --diagnose or --seeds")
    formats = [FORMATS[f] for f in (recipe.fwd, recipe.grad)]
    if args.diagnose and not all(f.is_mx or f.has_global_scale for f in formats):
        raise SystemExit(
            f"--diagnose records the telemetry of MX and NVFP4 GEMMs; --recipe {args.recipe} "
            f"uses {recipe.fwd} / {recipe.grad}"
        )
    diagnose_every = 0
    if args.diagnose:
        diagnose_every = args.diagnose_every or max(1, cfg.steps // 30)
    progress = not args.no_progress
    if args.advise:
        if args.ablate or args.diagnose or args.seeds:
            raise SystemExit("--advise does not combine with --ablate, --diagnose or --seeds")
        return _advise(cfg, args.advise_budget, args.out, progress)
    if args.ablate:
        runs = ablate(cfg, recipe, name=args.recipe, progress=progress)
        print(report.write_ablation(runs, args.out, config=cfg, recipe=recipe))
        return 0
    runs = compare(cfg, recipe, name=args.recipe, progress=progress, diagnose_every=diagnose_every)
    band = seed_band(cfg, args.seeds, progress=progress)
    summary = report.write(runs, args.out, config=cfg, recipe=recipe, band=band)
    print(summary.text)
    path = serve.save_model(runs[0].model, args.out)
    print(f"saved the bf16 model to {path}: python -m jaxmx.demo generate --out {args.out}")
    return 0


def _advise(cfg: Config, budget: float, out: str, progress: bool) -> int:
    """``--advise``: MXFP8, the advice on its trained model, then the advised recipes."""
    mxfp8 = train(cfg, get_recipe("mxfp8"), name="mxfp8", progress=progress)
    advice = advise.advise_model(mxfp8.model, cfg, budget)
    mapping = advice.recipes()
    advised = train(cfg, mapping, name="advised", progress=progress)
    text = advise.report(advice, mapping, mxfp8, advised)
    path = advise.write(text, advice, out)
    print(f"{text}\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
