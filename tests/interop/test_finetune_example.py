"""examples/finetune_fp8.py runs as documented (two steps here), and transformers loads what it
exports, with the logits of jaxmx's model on the exported weights. Slow for a test (about 30 s:
it compiles the example's MXFP8 training step), so it runs with the interop tests."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from examples_dir import load_example
from flax import nnx

import jaxmx.flax.nnx as mxnnx
from jaxmx import checkpoints

pytestmark = pytest.mark.interop


def test_finetune_fp8_example(tmp_path, capsys):
    example = load_example("finetune_fp8")
    result = example.main(["--steps", "2", "--out", str(tmp_path / "out")])
    assert result["scheme"] == example.FP8 and np.isfinite(result["losses"]).all()
    assert "MXFP8 steps" in capsys.readouterr().out

    tokens = np.arange(24).reshape(2, 12)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.from_numpy(tokens)).logits.numpy()
    ckpt = checkpoints.load(tmp_path / "out")
    model = example.llama.Llama(example.llama.Config.from_hf(ckpt.config), rngs=nnx.Rngs(0))
    mxnnx.load_checkpoint(model, ckpt)
    got = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(got, want, rtol=0, atol=32 * np.spacing(np.abs(want).max()))
