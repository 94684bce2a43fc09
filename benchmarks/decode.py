"""Decode step of the demo transformer: bytes of weights and KV cache per format, and the step
time against BF16.

For each batch size and context length: the demo model (``jaxmx.demo.model.Transformer``, random
weights, ``--d-model`` / ``--layers`` / ``--heads``, as many learned positions as the context)
decoding one token at the last position of a full cache, the jitted step of ``python -m
jaxmx.demo generate`` (``jaxmx.demo.serve.next_token``). ``bf16``: bfloat16 weights and a
bfloat16 cache; each other format: the linear layers' weights at rest in that format
(``jaxmx.flax.nnx.quantize_weights``, weight-only; embedding and head stay bfloat16) and a
``jaxmx.KVCache`` of the same format. The step times are interleaved medians after a compiling
warm-up (benchmarks/timing.py), all variants of a setting in the same run, printed with their
ratio to BF16.

    python benchmarks/decode.py --batch 1 8 --context 256 1024 --repeats 9
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx
from timing import MALLOC_CHOICES, interleaved_medians, malloc_setting, use_malloc

from jaxmx.demo import serve
from jaxmx.demo.model import Transformer, init_caches
from jaxmx.flax.nnx import quantize_weights

FORMATS = ("bf16", "mxfp8_e4m3", "mxfp4", "nvfp4")


def variant(model: Transformer, fmt: str, batch: int, context: int):
    """``(step, weight bytes, cache bytes)`` of ``model`` (bf16 weights) served in ``fmt``:
    ``step()`` decodes one token per sequence at position ``context - 1``."""
    if fmt == "bf16":  # the bytes of the same layers (the report's) in bfloat16
        served, cache_fmt = model, None
        weight_bytes = quantize_weights(nnx.clone(model), "mxfp8_e4m3").bf16_nbytes
    else:
        served, cache_fmt = nnx.clone(model), fmt
        weight_bytes = quantize_weights(served, fmt).nbytes
    caches = init_caches(served, batch, context, cache_fmt)
    graphdef, state = nnx.split(served)
    tokens = jnp.zeros((batch, 1), jnp.int32)
    index = jnp.int32(context - 1)

    def step():
        return serve.next_token(graphdef, state, caches, tokens, index)

    return step, weight_bytes, sum(c.nbytes for c in caches)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--malloc", choices=MALLOC_CHOICES, default="default")
    args = p.parse_args(argv)
    use_malloc(args.malloc)
    formats = ["bf16", *(f for f in args.formats if f != "bf16")]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, malloc {malloc_setting()}")
    print(
        f"d_model {args.d_model}, layers {args.layers}, heads {args.heads}; times: median of "
        f"{args.repeats} interleaved steps"
    )
    for context in args.context:
        model = serve.bf16_weights(
            Transformer(256, args.d_model, args.layers, args.heads, context, rngs=nnx.Rngs(0))
        )
        for batch in args.batch:
            runs = {f: variant(model, f, batch, context) for f in formats}
            times = interleaved_medians({f: r[0] for f, r in runs.items()}, (), args.repeats)
            _, w0, c0 = runs["bf16"]
            t0 = times["bf16"].seconds
            print(f"\nbatch {batch}, context {context}")
            print(f"{'format':12s} {'weights (B)':>18s} {'KV cache (B)':>20s} {'step (ms)':>16s}")
            for f, (_, w, c) in runs.items():
                t = times[f].seconds
                print(
                    f"{f:12s} {w:>10,} x{w / w0:.3f} {c:>12,} x{c / c0:.3f} "
                    f"{t * 1e3:>9.2f} x{t / t0:.2f}"
                )


if __name__ == "__main__":
    main()
