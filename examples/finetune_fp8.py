"""Fine-tune a model from a DeepSeek-style block-FP8 checkpoint and export it back, with jaxmx.

1. A small Llama (examples/llama.py) is written as a block-FP8 checkpoint, the layout
   DeepSeek-V3 and Qwen3-FP8 ship (E4M3 weights, one float32 decode scale per 128x128 tile,
   transformers' ``quantization_config``), standing in for a downloaded one.
2. ``jaxmx.checkpoints.load`` reads it with no decode; ``load_checkpoint`` sets the model's
   float32 master weights from it.
3. A few steps of byte-level language modelling on a local text (this repository's README),
   with the projections trained through MXFP8 GEMMs (``quantize_model``).
4. ``export_checkpoint(..., like=checkpoint)`` writes the same layout back: each weight is
   requantized against the loaded scales, so a block keeps its scale unless its new values
   outgrew it, and transformers' loader reads the result.

    python examples/finetune_fp8.py [--steps 20] [--out finetuned-fp8]
"""

import argparse
import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxmx
import jaxmx.flax.nnx as mxnnx
from jaxmx import checkpoints

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import llama

CONFIG = llama.Config(
    vocab_size=256,  # bytes
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
FP8 = checkpoints.Scheme(method="fp8", weights="block", block_size=(128, 128))


def write_fp8_checkpoint(path: pathlib.Path) -> None:
    """A random model written as a block-FP8 checkpoint. k_proj and v_proj ([64, 128]: 64 rows,
    one block row) quantize too; transformers reads a weight a 128-block does not divide only
    when it spans one block."""
    model = llama.Llama(CONFIG, rngs=nnx.Rngs(0))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    config.update(dataclasses.asdict(CONFIG))
    mxnnx.export_checkpoint(model, path, scheme=FP8, config=config)


def batches(text: bytes, *, batch: int, length: int, seed: int = 0):
    """Random windows of ``text`` as byte tokens ``[batch, length + 1]``."""
    data = np.frombuffer(text, np.uint8).astype(np.int32)
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - length - 1, batch)
        yield jnp.asarray(np.stack([data[s : s + length + 1] for s in starts]))


def finetune(model, steps: int, text: bytes) -> list[float]:
    """``steps`` Adam steps of next-byte prediction, the projections in MXFP8."""
    mxnnx.quantize_model(model, recipe=jaxmx.recipes.MXFP8)
    optimizer = nnx.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens):
        def loss(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    data = batches(text, batch=8, length=64)
    return [float(step(model, optimizer, next(data))) for _ in range(steps)]


def kept_scales(before: checkpoints.Checkpoint, after: checkpoints.Checkpoint) -> float:
    """The fraction of block scales the export kept from the loaded checkpoint."""
    same = [
        np.asarray(q.scale) == np.asarray(after.tensors[name].scale)
        for name, q in before.tensors.items()
        if isinstance(q, jaxmx.MXArray)
    ]
    return float(np.mean(np.concatenate([s.ravel() for s in same])))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("finetuned-fp8"))
    args = parser.parse_args(argv)
    source = args.out.with_name(args.out.name + "-source")
    write_fp8_checkpoint(source)

    checkpoint = checkpoints.load(source)
    print(f"loaded {source}: {checkpoint.scheme}")
    model = llama.Llama(llama.Config.from_hf(checkpoint.config), rngs=nnx.Rngs(1))
    report = mxnnx.load_checkpoint(model, checkpoint)
    print(report)

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_bytes()
    losses = finetune(model, args.steps, text)
    print(f"loss: {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} MXFP8 steps")

    mxnnx.export_checkpoint(model, args.out, like=checkpoint)
    exported = checkpoints.load(args.out)
    kept = kept_scales(checkpoint, exported)
    print(
        f"exported {args.out}: {exported.scheme.method} {exported.scheme.weights}; "
        f"{kept:.1%} of the tile scales kept from the loaded checkpoint (a tile takes a new "
        "scale only where training took its largest value beyond what its scale holds)"
    )
    return {"losses": losses, "kept": kept, "scheme": exported.scheme}


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    main()
