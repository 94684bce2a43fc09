"""The demo's command line (argparse only): ``python -m jaxmx.demo`` parses it before it imports
the training modules (flax, optax, orbax), so ``--help`` and a bad flag answer at once. It reads
only jaxmx's format, backend and saved-activation names, which load without JAX.

Example:
    >>> parse(["--steps", "3"]).steps, parse(["generate", "--length", "5"]).length
    (3, 5)
"""

from __future__ import annotations

import argparse

from jaxmx import BACKENDS, FORMATS, SAVE_FORMATS
from jaxmx.demo.config import RECIPES, Config

DESCRIPTION = "The jaxmx demo: the same small transformer trained in BF16 and in MXFP8, compared."

_DEFAULTS = Config()


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line; ``--help`` shows every flag with its default."""
    p = argparse.ArgumentParser(
        prog="python -m jaxmx.demo",
        description=DESCRIPTION,
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
        choices=FORMATS,
        default="mxfp8_e4m3",
        help="format of the linear layers' weights at rest (weight-only)",
    )
    p.add_argument(
        "--cache-fmt", choices=FORMATS, default="mxfp8_e4m3", help="format of the MX KV cache"
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
    fits = sorted(n for n, f in FORMATS.items() if f.span == "block" and head_dim % f.block == 0)
    hint = [f"{' / '.join(fits)} fits"] if fits else []
    if d_model % block == 0:
        h = max(h for h in range(1, d_model // block + 1) if d_model % (block * h) == 0)
        hint.append(f"--heads {h} gives head_dim {d_model // h}")
    return (
        f"note: head_dim {head_dim} (--d-model {d_model} / --heads {heads}) is not a multiple of "
        f"{block}: `generate` will refuse its default --cache-fmt mxfp8_e4m3 and the other "
        f"{block}-blocked formats" + (f" ({'; '.join(hint)})" if hint else "")
    )


def parse(argv: list[str]) -> argparse.Namespace:
    """``argv`` read by the training parser, or after ``generate`` by :func:`build_generate_parser`;
    exits (argparse) on ``--help`` or a bad flag."""
    if argv[:1] == ["generate"]:
        return build_generate_parser().parse_args(argv[1:])
    return parse_args(argv)
