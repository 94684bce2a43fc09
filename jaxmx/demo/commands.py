"""What ``python -m jaxmx.demo`` runs (:func:`main`): the same small transformer trained in BF16
and in MXFP8, compared.

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

import sys

import jax

from jaxmx import FORMATS
from jaxmx.demo import advise, report, serve
from jaxmx.demo.cli import build_generate_parser, cache_note, parse_args
from jaxmx.demo.config import KEEP_LAST, Config
from jaxmx.demo.train import ablate, compare, get_recipe, seed_band, train


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
    if args.diagnose and not all(f.has_block_statistics for f in formats):
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
