"""End to end with transformers: examples/llama.py (Flax nnx) loads checkpoints saved from a small
random ``LlamaForCausalLM`` (high precision; DeepSeek's block FP8, quantized by transformers'
own saver; MXFP4, compressed by compressed-tensors) and gives transformers' logits on the same
tokens; fine-tuned a few steps in jaxmx (MXFP8 training GEMMs) and exported against the loaded
checkpoint, it is loaded back by transformers, whose logits equal jaxmx's."""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import optax
import peers
import pytest
import safetensors.torch
import torch
import transformers
from examples_dir import load_example
from flax import nnx
from safetensors_bytes import raw_tensors

import jaxmx
import jaxmx.flax.nnx as mxnnx
from jaxmx import checkpoints

pytestmark = pytest.mark.interop

llama = load_example("llama")

# hidden and intermediate sizes multiples of 128: transformers' FP8 saver quantizes only weights
# its 128x128 blocks divide (it leaves k_proj and v_proj, 64 rows, in float32)
SIZES = dict(
    vocab_size=96,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TOKENS = np.random.default_rng(1).integers(0, SIZES["vocab_size"], (2, 12))


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)).float().eval()


def hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS)).logits.numpy()


def jaxmx_logits(model) -> np.ndarray:
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(TOKENS, jnp.int32)))


def assert_same_logits(got, want):
    """Equal within float32 summation error: the same float32 operations summed in another order
    (tests/interop/test_llama_logits.py measures 2-4 ulps of the largest logit; 32 allowed)."""
    np.testing.assert_allclose(got, want, rtol=0, atol=32 * np.spacing(np.abs(want).max()))


def from_pretrained(path) -> transformers.LlamaForCausalLM:
    """transformers' own load of a checkpoint directory, in float32 (quantized weights are
    dequantized on a CPU)."""
    qc = json.loads((pathlib.Path(path) / "config.json").read_text()).get("quantization_config")
    kwargs = {}
    if qc is not None and qc["quant_method"] == "compressed-tensors":
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)


def save_quantized(hf, path: pathlib.Path, layout: str) -> None:
    """``hf`` saved by the peers' own writers: the projections quantized by transformers' FP8
    saver (``"fp8"``) or compressed-tensors' MXFP4 compressor (``"mxfp4"``), the other tensors
    (embeddings, norms, lm_head) in float32, config.json the model's plus the peer's
    quantization_config."""
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    projections = {k.removesuffix(".weight"): v for k, v in state.items() if "_proj." in k}
    rest = {k: v for k, v in state.items() if "_proj." not in k}
    if layout == "fp8":
        peers.write_fp8_transformers(path, projections, block_size=(128, 128))
        tensors = safetensors.torch.load_file(path / "model.safetensors")
        tensors.update({k: torch.from_numpy(v) for k, v in rest.items()})
        safetensors.torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    else:
        peers.write_compressed_tensors(path, projections, "MXFP4", extra=rest)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    if layout == "mxfp4":
        qc["ignore"] = ["lm_head"]  # CT's targets "Linear" take every Linear otherwise
    (path / "config.json").write_text(
        json.dumps({**hf.config.to_dict(), "quantization_config": qc})
    )


def master_weight(model, name: str) -> np.ndarray:
    """The ``[out, in]`` float32 master weight of the tensor ``name`` (``model.layers.1...``)."""
    layer = model
    for part in name.removesuffix(".weight").split("."):
        layer = layer[int(part)] if part.isdigit() else getattr(layer, part)
    return np.asarray(layer.kernel.get_value()).T


def check_kept_scales(old, new, w: np.ndarray) -> np.ndarray:
    """Each block of the exported weight ``new`` kept ``old``'s scale where the trained weight
    ``w`` still fits it and took another where ``w`` outgrew it, by a numpy reckoning of the
    blocks (128x128 tiles of float32 scales for FP8, 32-blocks of E8M0 scales for MXFP4): a
    block fits while its amax is at most ``elem_max * (1 + 2^-(mbits + 3)) * scale``
    (docs/checkpoints.md: values that still round to at most the element maximum); blocks
    within 0.1% of that bound are not judged. Returns which blocks changed their scale."""
    if old.fmt == "fp8_e4m3_block":
        (rows, cols), elem_max, mbits = old.tile, 448.0, 3
        s_old = np.asarray(old.scale, np.float64)
    else:
        rows, cols, elem_max, mbits = 1, 32, 6.0, 1
        s_old = 2.0 ** (np.asarray(old.scale).view(np.uint8).astype(np.float64) - 127)
    out, k = w.shape
    padded = np.zeros((-(-out // rows) * rows, -(-k // cols) * cols))
    padded[:out, :k] = np.abs(w)
    amax = padded.reshape(padded.shape[0] // rows, rows, -1, cols).max(axis=(1, 3))
    ratio = amax / (elem_max * (1 + 2.0 ** -(mbits + 3)) * s_old)
    changed = np.asarray(new.scale, np.float32) != np.asarray(old.scale, np.float32)
    assert not changed[ratio <= 0.999].any() and changed[ratio > 1.001].all()
    return changed


def loaded_llama(path, **load):
    ckpt = checkpoints.load(path)
    model = llama.Llama(llama.Config.from_hf(ckpt.config), rngs=nnx.Rngs(0))
    report = mxnnx.load_checkpoint(model, ckpt, **load)
    return model, ckpt, report


@pytest.mark.parametrize("layout", ["high_precision", "fp8", "mxfp4"])
def test_loads_transformers_checkpoints(tmp_path, hf_model, layout):
    """transformers -> jaxmx: the nnx model's logits equal transformers' on its own load of the
    same directory (a quantized checkpoint dequantized by transformers)."""
    if layout == "high_precision":
        hf_model.save_pretrained(tmp_path)
    else:
        save_quantized(hf_model, tmp_path, layout)
    model, ckpt, report = loaded_llama(tmp_path)
    assert not report.unused
    quantized = [n for n, t in ckpt.tensors.items() if isinstance(t, jaxmx.MXArray)]
    assert len(quantized) == {"high_precision": 0, "fp8": 10, "mxfp4": 14}[layout]
    assert_same_logits(jaxmx_logits(model), hf_logits(from_pretrained(tmp_path)))


@pytest.mark.parametrize("layout", ["fp8", "mxfp4"])
def test_fine_tune_export_and_load_back(tmp_path, hf_model, layout):
    """jaxmx fine-tune -> export -> transformers: a few MXFP8 training steps on the loaded
    master weights of the second decoder layer, exported against the loaded checkpoint (the
    first layer's weights, untouched, come back byte for byte; the trained ones keep each
    scale their new values fit); transformers loads the export and its logits equal jaxmx's
    on the exported weights."""
    save_quantized(hf_model, tmp_path / "src", layout)
    model, ckpt, _ = loaded_llama(tmp_path / "src")
    mxnnx.quantize_model(model, recipe=jaxmx.recipes.MXFP8)
    trained = nnx.All(nnx.Param, nnx.PathContains(1))  # model/layers/1/...
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=trained)

    @nnx.jit
    def step(model, optimizer, tokens):
        def loss(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, trained))(model)
        optimizer.update(model, grads)
        return value

    tokens = jnp.asarray(TOKENS, jnp.int32)
    losses = [float(step(model, optimizer, tokens)) for _ in range(3)]
    assert losses[-1] < losses[0]
    mxnnx.export_checkpoint(model, tmp_path / "out", like=ckpt)

    exported = raw_tensors(tmp_path / "out")
    original = raw_tensors(tmp_path / "src")
    assert exported.keys() == original.keys()
    for name in original:  # the first layer untouched: the same bytes; the second's weights moved
        if ".layers.1." not in name:
            assert exported[name] == original[name], name
        elif not name.endswith(("_scale", "_scale_inv")):  # scales: checked block by block below
            assert exported[name] != original[name], name
    back = checkpoints.load(tmp_path / "out")
    assert back.scheme == ckpt.scheme
    changed = [
        check_kept_scales(q, back.tensors[name], master_weight(model, name)).ravel()
        for name, q in ckpt.tensors.items()
        if isinstance(q, jaxmx.MXArray) and ".layers.1." in name
    ]
    assert 0 < np.concatenate(changed).mean() < 1  # both kept and fresh scales occur
    reloaded, _, _ = loaded_llama(tmp_path / "out")
    assert_same_logits(jaxmx_logits(reloaded), hf_logits(from_pretrained(tmp_path / "out")))
