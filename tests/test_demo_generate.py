"""Serving the demo model: the KV-cache decode path against the full forward pass, one compiled
decode step, the bytes of MX weights and cache, and ``python -m jaxmx.demo generate``."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmx
from jaxmx.demo import data, serve
from jaxmx.demo.cli import build_generate_parser
from jaxmx.demo.commands import main
from jaxmx.demo.model import DenseCache, Transformer, init_caches
from jaxmx.demo.train import Config, build_model
from jaxmx.flax.nnx import quantize_weights

D, SEQ = 32, 16


def _model(dtype=jnp.float32, heads=1, layers=2, seed=0) -> Transformer:
    """A small model whose zero-initialized output projections are filled in, so that attention
    and the MLP reach the logits."""
    m = Transformer(256, D, layers, heads, SEQ, dtype=dtype, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 1)
    for i, block in enumerate(m.blocks):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        block.attn.out.kernel[...] = 0.3 * jax.random.normal(k1, (D, D))
        block.mlp.down.kernel[...] = 0.1 * jax.random.normal(k2, (4 * D, D))
    return m


def _tokens(batch=2, t=SEQ):
    return jax.random.randint(jax.random.key(7), (batch, t), 0, 256, jnp.int32)


def _decoded_logits(model, tokens, fmt, prefill=5):
    """Logits of a prefill of ``prefill`` tokens, then one token per jitted step (traced index)."""
    graphdef, state = nnx.split(model)
    caches = init_caches(model, tokens.shape[0], SEQ, fmt)
    logits, caches = serve.forward(graphdef, state, caches, tokens[:, :prefill], 0)
    out = [logits]
    for i in range(prefill, tokens.shape[1]):
        logits, caches = serve.forward(graphdef, state, caches, tokens[:, i : i + 1], jnp.int32(i))
        out.append(logits)
    return np.asarray(jnp.concatenate(out, axis=1))


@pytest.mark.parametrize(
    "dtype, atol",
    [
        (jnp.float32, 2e-5),  # float32 rounding (summation order of the attention products)
        (jnp.bfloat16, 0.15),  # bfloat16 activations: a few bf16 ulps of logits of size ~4
    ],
)
def test_decode_with_a_dense_cache_equals_the_full_forward_at_each_position(dtype, atol):
    model = _model(dtype, heads=2)
    tokens = _tokens()
    full = np.asarray(model(tokens))  # nnx.dot_product_attention, causal, whole sequence
    assert np.abs(full).max() > 1.0  # attention and the MLP do reach the logits
    np.testing.assert_allclose(_decoded_logits(model, tokens, None), full, atol=atol, rtol=0)


def test_greedy_decode_matches_greedy_by_full_forward():
    model = _model()
    run = serve.decode(model, b"ab", 8, fmt=None)
    full = nnx.jit(lambda m, window: m(window))  # causal: what follows a prefix is ignored
    tokens = list(b"ab")
    for _ in range(8):  # the reference: recompute the whole prefix each token, no cache
        window = jnp.zeros((1, SEQ), jnp.int32).at[0, : len(tokens)].set(jnp.asarray(tokens))
        tokens.append(int(jnp.argmax(full(model, window)[0, len(tokens) - 1])))
    assert run.text == bytes(tokens[2:])


def test_mx_cache_decode_is_close_to_the_full_forward():
    model = _model(jnp.bfloat16)
    tokens = _tokens()
    full = np.asarray(model(tokens))
    mx = _decoded_logits(model, tokens, "mxfp8_e4m3")
    err = np.abs(mx - full).max()
    assert 0 < err < 0.1 * np.abs(full).max()  # quantized K, V and q: close, not equal


def test_the_decode_step_compiles_once():
    model = _model(heads=1, layers=1, seed=3)
    before = serve.next_token._cache_size()
    serve.decode(model, b"xyz", 6, fmt="mxfp8_e4m3")  # a prefill, then 5 steps
    after_one = serve.next_token._cache_size()
    assert after_one - before == 2  # the prefill's program and the step's
    serve.decode(model, b"uvw", 9, fmt="mxfp8_e4m3")  # same shapes: nothing new
    assert serve.next_token._cache_size() == after_one


CFG = Config(d_model=64, layers=1, heads=2, seq_len=SEQ, batch=2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trained-looking model saved as the demo's training run saves it, and its serve report
    (the CLI test below restores the same model: the compiled programs are shared)."""
    out = tmp_path_factory.mktemp("demo")
    model = build_model(CFG)
    for i, block in enumerate(model.blocks):  # fill the zero-initialized projections
        block.attn.out.kernel[...] = 0.3 * jax.random.normal(jax.random.key(i), (64, 64))
        block.mlp.down.kernel[...] = 0.1 * jax.random.normal(jax.random.key(9), (256, 64))
    serve.save_model(model, out)
    (out / "history.json").write_text(json.dumps({"config": dataclasses.asdict(CFG)}))
    report = serve.serve(model, prompt=b"Th", length=6, batch=CFG.batch, eval_batches=1)
    return out, model, report


def test_mx_weights_and_cache_bytes(saved):
    _, model, report = saved
    dense = init_caches(model, 3, SEQ)
    mx = init_caches(model, 3, SEQ, "mxfp8_e4m3")
    assert isinstance(dense[0], DenseCache) and isinstance(mx[0], jaxmx.KVCache)
    elements = 2 * 3 * SEQ * 2 * 32  # K and V, batch 3, 2 heads of 32
    assert dense[0].nbytes == 2 * elements  # bfloat16
    assert mx[0].nbytes == elements + elements // 32  # E4M3 codes, an E8M0 scale per 32
    assert mx[0].nbytes <= 0.52 * dense[0].nbytes

    # the four block layers' [N, K] weights: one byte per element, an E8M0 byte per 32 along K;
    # embed and head as bf16 tables
    shapes = [(64, 3 * 64), (64, 64), (64, 4 * 64), (4 * 64, 64)]  # (K, N)
    mx_bytes = sum(n * k + n * (k // 32) for k, n in shapes) + 2 * (2 * 256 * 64)
    bf16_bytes = sum(2 * k * n for k, n in shapes) + 2 * (2 * 256 * 64)
    assert (report.weight_nbytes_mx, report.weight_nbytes_bf16) == (mx_bytes, bf16_bytes)
    assert (report.bf16.cache_nbytes, report.mx.cache_nbytes) == (
        2 * SEQ * 64 * 2,  # K and V, batch 1, bfloat16
        2 * SEQ * (64 + 2),  # E4M3 codes and 2 scales per token and head pair
    )


def test_serve_agreement_and_validation_nll(saved):
    _, model, report = saved
    assert len(report.bf16.text) == len(report.mx.text) == 6
    # agreement: the MX model's greedy token after each prefix of the bf16 text, computed here
    # by a full forward pass of the MX-weight model (bf16 attention instead of the MX cache)
    mx_model = serve.bf16_weights(model)
    quantize_weights(mx_model, "mxfp8_e4m3")
    context = jnp.asarray([list(b"Th" + report.bf16.text)])[:, :-1]
    predicted = np.asarray(jnp.argmax(mx_model(context), -1))[0, 1:]
    assert report.agreement == pytest.approx(np.mean(predicted == list(report.bf16.text)))
    # validation nll: one window batch, by the full forward pass and numpy
    x, y = data.eval_batches(data.load_splits()[1], CFG.batch, SEQ, 1)[0]
    logits = np.asarray(serve.bf16_weights(model)(jnp.asarray(x)), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, y[..., None], -1).mean()
    assert report.nll_bf16 == pytest.approx(nll, rel=2e-3)
    assert report.nll_mx == pytest.approx(nll, rel=0.05) and report.nll_mx != report.nll_bf16


def test_save_and_load_model_round_trip(saved):
    out, model, _ = saved
    restored, restored_cfg = serve.load_model(out)
    assert restored_cfg == CFG
    for a, b in zip(*(jax.tree.leaves(nnx.state(m)) for m in (model, restored)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_cli_generate_prints_both_texts_and_the_comparison(saved, capsys):
    out_dir, _, report = saved
    args = ["--out", str(out_dir), "--prompt", "Th", "--length", "6", "--eval-batches", "1"]
    assert main(["generate", *args]) == 0
    out = capsys.readouterr().out
    assert str(report).splitlines()[:4] == out.splitlines()[2:6]  # prompt, texts, agreement
    lines = {line.split(":")[0]: line for line in out.splitlines() if ":" in line}
    assert lines["prompt"] == "prompt: 'Th'"
    assert "bf16 weights, bf16 cache" in lines and "mxfp8_e4m3 weights, mxfp8_e4m3 cache" in lines
    assert "/6 = " in lines["per-token agreement (teacher forced on the bf16 text)"]
    for row in ("validation nll (nats/byte)", "weights (bytes)", "KV cache (bytes)"):
        assert any(line.startswith(row) for line in out.splitlines()), row
    speed = next(line for line in out.splitlines() if line.startswith("decode (tokens/s)"))
    assert float(speed.split()[2]) > 0 and float(speed.split()[3]) > 0
    assert "blocks/0/mlp/up" in out and "mxfp8_e4m3, weights only" in out  # the weights report

    with pytest.raises(SystemExit, match=r"len\(prompt\) \+ length <= the model's context 16"):
        main(["generate", "--out", str(out_dir), "--length", "20"])
    with pytest.raises(SystemExit, match=r"no trained demo model in .*: run python -m jaxmx.demo"):
        main(["generate", "--out", str(out_dir / "none")])
    flags = build_generate_parser().parse_args(["--weights-fmt", "nvfp4", "--cache-fmt", "mxfp4"])
    assert (flags.weights_fmt, flags.cache_fmt, flags.eval_batches) == ("nvfp4", "mxfp4", 4)


def test_generate_help_describes_every_flag_and_its_default():
    parser = build_generate_parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        assert action.help, action.option_strings
        if action.dest != "help":
            assert f"(default: {action.default})" in text, action.option_strings
