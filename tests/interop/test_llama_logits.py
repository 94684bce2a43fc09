"""examples/llama.py computes the logits of transformers' ``LlamaForCausalLM`` on the same
weights and tokens (float32, CPU), with separate and with tied word embeddings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from examples_dir import load_example
from flax import nnx

pytestmark = pytest.mark.interop

llama = load_example("llama")

SIZES = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def _load(model: llama.Llama, tensors: dict[str, np.ndarray]) -> None:
    """Sets each parameter of ``model`` from the Hugging Face tensor of the same dotted name
    (``kernel`` from ``weight`` transposed, ``scale`` and ``embedding`` from ``weight``), and
    checks that every tensor was used once."""
    unused = dict(tensors)
    for path, param in nnx.iter_graph(model):
        if not isinstance(param, nnx.Param):
            continue
        *module, leaf = (str(p) for p in path)
        value = unused.pop(".".join([*module, "weight"]))
        if leaf == "kernel":
            value = value.T
        assert value.shape == param.shape, (path, value.shape, param.shape)
        param.set_value(jnp.asarray(value, param.dtype))
    assert not unused, sorted(unused)


def _pair(tie: bool, seed: int):
    torch.manual_seed(seed)
    hf_config = transformers.LlamaConfig(**SIZES, tie_word_embeddings=tie)
    hf = transformers.LlamaForCausalLM(hf_config).float().eval()
    tensors = {name: t.detach().numpy() for name, t in hf.state_dict().items()}
    if tie:  # one table, listed under both names
        assert np.shares_memory(tensors.pop("lm_head.weight"), tensors["model.embed_tokens.weight"])
    config = llama.Config.from_hf(hf_config.to_dict())
    ours = llama.Llama(config, rngs=nnx.Rngs(0))
    _load(ours, tensors)
    return hf, ours


def test_config_from_hf():
    hf_config = transformers.LlamaConfig(**SIZES, tie_word_embeddings=True)
    config = llama.Config.from_hf(hf_config.to_dict())
    assert config == llama.Config(**SIZES, tie_word_embeddings=True)
    assert config.head_dim == 16
    old_style = {**SIZES, "rope_scaling": None, "rope_theta": 500000.0}
    assert llama.Config.from_hf(old_style).rope_theta == 500000.0
    with pytest.raises(NotImplementedError, match="llama3"):
        llama.Config.from_hf({**SIZES, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


@pytest.mark.parametrize("tie", [False, True], ids=["separate_head", "tied_embeddings"])
def test_logits_match_transformers(tie):
    hf, ours = _pair(tie, seed=0)
    tokens = np.random.default_rng(1).integers(0, SIZES["vocab_size"], (2, 12))
    with torch.no_grad():
        expected = hf(torch.from_numpy(tokens)).logits.numpy()
    got = np.asarray(jax.jit(ours)(jnp.asarray(tokens, jnp.int32)))
    assert got.dtype == np.float32 and got.shape == expected.shape == (2, 12, 96)
    # The same float32 operations summed in a different order (XLA's GEMMs, softmax and rsqrt
    # against torch's): measured at 2-4 ulps of the largest logit (|logit| <= ~1.2 here, so
    # <= 3.6e-7). 32 ulps leaves 8x headroom for another CPU's summation order and is still
    # ~1e4 times below what a wrong convention costs (interleaved or no rope, query heads
    # grouped n % kv instead of n // kv: ~1.5e-2 of the logits' scale).
    atol = 32 * np.spacing(np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=0, atol=atol)
