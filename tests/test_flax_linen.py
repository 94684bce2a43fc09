"""jaxmx.flax.linen: Dense, DenseGeneral, Einsum and dot_general(recipe) against flax.linen."""

import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as mxref
from flax import serialization

import jaxmx
import jaxmx.flax.linen as mxl

MX = jaxmx.recipes.MXFP8


def _qdq(a, axis):
    """``a`` quantized to MXFP8 E4M3 (rceil, blocks of 32 along ``axis``) and dequantized by the
    independent reference in tests/reference.py; float32 (exact: fp8 codes times powers of 2)."""
    a = np.asarray(a, np.float32)
    data, scale = mxref.quantize(a, "mxfp8_e4m3", "rceil", axis=axis)
    return mxref.dequantize(data, scale, axis, a.shape).astype(np.float32)


def _rel(a, b):
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(1), (4, 8, 64), jnp.float32)


CASES = [
    (mxl.Dense, nn.Dense, dict(features=48)),
    (mxl.DenseGeneral, nn.DenseGeneral, dict(features=(3, 16), axis=-1)),
    (mxl.Einsum, nn.Einsum, dict(shape=(64, 48), einsum_str="btd,dh->bth")),
]


@pytest.mark.parametrize(("cls", "ref_cls", "kw"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_recipe_none_matches_flax_exactly(cls, ref_cls, kw, x):
    ref = ref_cls(**kw)
    params = ref.init(jax.random.key(0), x)
    mine = cls(**kw, recipe=None)
    assert jax.tree.structure(mine.init(jax.random.key(0), x)) == jax.tree.structure(params)
    np.testing.assert_array_equal(mine.apply(params, x), ref.apply(params, x))


@pytest.mark.parametrize(("cls", "ref_cls", "kw"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_mx_matches_mx_definition_and_flax_closely(cls, ref_cls, kw, x):
    ref = ref_cls(**kw)
    params = ref.init(jax.random.key(0), x)
    y = cls(**kw).apply(params, x)
    y_ref = ref.apply(params, x)
    err = _rel(y, y_ref)
    assert 1e-3 < err < 0.05, err  # really quantized, and close to high precision
    # The MX definition: flax's layer on both operands quantized along the reduction (x along
    # its last axis, the kernel along its contracted first axis), exact products, f32 sum.
    xq, kq = _qdq(x, -1), _qdq(params["params"]["kernel"], 0)
    mx_params = {"params": {**params["params"], "kernel": kq}}
    np.testing.assert_allclose(y, ref.apply(mx_params, xq), rtol=1e-5, atol=1e-5)


def test_dot_general_for_stock_dense(x):
    stock = nn.Dense(32, dot_general=mxl.dot_general(MX))
    params = stock.init(jax.random.key(0), x)
    np.testing.assert_array_equal(stock.apply(params, x), mxl.Dense(32).apply(params, x))
    assert _rel(stock.apply(params, x), nn.Dense(32).apply(params, x)) > 1e-3
    off = nn.Dense(32, dot_general=mxl.dot_general(None))
    np.testing.assert_array_equal(off.apply(params, x), nn.Dense(32).apply(params, x))
    assert mxl.dot_general() == mxl.dot_general(MX)  # the default recipe; hashable and equal
    assert hash(mxl.dot_general(MX)) == hash(mxl.dot_general(MX))


def test_recipe_field_and_clone(x):
    layer = mxl.Dense(16)
    assert layer.recipe == MX and layer.dot_general.recipe == MX
    hybrid = layer.clone(recipe=jaxmx.recipes.MXFP8_HYBRID)
    assert hybrid.dot_general.recipe == jaxmx.recipes.MXFP8_HYBRID
    params = layer.init(jax.random.key(0), x)
    np.testing.assert_array_equal(
        layer.clone(recipe=None).apply(params, x), nn.Dense(16).apply(params, x)
    )


def test_params_keep_user_dtype(x):
    for dtype in (jnp.float32, jnp.bfloat16):
        layer = mxl.Dense(16, param_dtype=dtype, dtype=jnp.bfloat16)
        params = layer.init(jax.random.key(0), x)
        assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(dtype)}
        assert layer.apply(params, x).dtype == jnp.bfloat16


def test_gradients_flow_and_match_high_precision(x):
    layer, ref = mxl.Dense(32), nn.Dense(32)
    params = ref.init(jax.random.key(0), x)
    target = jax.random.normal(jax.random.key(2), (4, 8, 32))

    def loss(m, p, x):
        return jnp.mean((m.apply(p, x) - target) ** 2)

    g, gx = jax.grad(loss, argnums=(1, 2))(layer, params, x)
    g_ref, gx_ref = jax.grad(loss, argnums=(1, 2))(ref, params, x)
    for a, b in zip(jax.tree.leaves((g, gx)), jax.tree.leaves((g_ref, gx_ref)), strict=True):
        assert bool(jnp.all(jnp.isfinite(a))) and float(jnp.abs(a).max()) > 0
        assert _rel(a, b) < 0.1


def test_jitted_optax_training_lowers_loss():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.gelu(mxl.Dense(64)(x))
            x = nn.gelu(mxl.DenseGeneral(64)(x))
            return mxl.Einsum((64, 8), "bd,do->bo")(x)

    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (64, 32))
    y = jnp.sin(x @ jax.random.normal(kw, (32, 8)))
    model = MLP()
    params = model.init(jax.random.key(1), x)
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    losses = []
    for _ in range(40):
        params, opt, loss = step(params, opt)
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.3 * losses[0], losses


def test_checkpoint_roundtrip(x, tmp_path):
    import orbax.checkpoint as ocp

    layer = mxl.Dense(16)
    params = layer.init(jax.random.key(0), x)
    params = jax.tree.map(lambda p: p + 0.5, params)  # not the init values
    fresh = layer.init(jax.random.key(9), x)
    restored = serialization.from_bytes(fresh, serialization.to_bytes(params))
    np.testing.assert_array_equal(layer.apply(restored, x), layer.apply(params, x))

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", params)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "ckpt", fresh)
    jax.tree.map(np.testing.assert_array_equal, restored, params)
    np.testing.assert_array_equal(layer.apply(restored, x), layer.apply(params, x))


def test_import_jaxmx_does_not_import_flax():
    code = "import sys, jaxmx; assert 'flax' not in sys.modules; import jaxmx.flax; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


# --- whole-model conversion ---------------------------------------------------------------------


class TransformerLM(nn.Module):
    """A decoder-only LM in the style of Flax's lm1b example, written with stock Flax layers."""

    vocab: int = 32
    width: int = 64
    heads: int = 4
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width, name="embed")(tokens)
        mask = nn.make_causal_mask(tokens)
        for i in range(self.layers):
            h = nn.LayerNorm(name=f"block_{i}_ln1")(x)
            h = nn.MultiHeadDotProductAttention(self.heads, name=f"block_{i}_attn")(h, h, mask=mask)
            x = x + h
            h = nn.LayerNorm(name=f"block_{i}_ln2")(x)
            h = nn.Dense(4 * self.width, name=f"block_{i}_mlp_up")(h)
            x = x + nn.Dense(self.width, name=f"block_{i}_mlp_down")(nn.gelu(h))
        return nn.Dense(self.vocab, name="logits")(nn.LayerNorm(name="final_ln")(x))


def lm_batch():
    first = jnp.arange(8)[:, None] % 32
    return (first + 5 * jnp.arange(33)[None, :]) % 32  # [8, 33] tokens, a learnable pattern


def count_jaxmx_gemms(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("custom_vjp_call")


def test_quantize_model_converts_an_unmodified_transformer_lm():
    model = TransformerLM()
    mx = mxl.quantize_model(model, MX)
    tokens = lm_batch()[:, :-1]
    params = model.init(jax.random.key(0), tokens)
    mx_params = mx.init(jax.random.key(0), tokens)
    jax.tree.map(np.testing.assert_array_equal, mx_params, params)  # the same tree and values
    # every attention projection and MLP layer is an MX GEMM; embeddings and the head are not
    assert count_jaxmx_gemms(lambda p: mx.apply(p, tokens), params) == 2 * (4 + 2)
    assert count_jaxmx_gemms(lambda p: model.apply(p, tokens), params) == 0
    y, y_ref = mx.apply(params, tokens), model.apply(params, tokens)
    assert 1e-3 < _rel(y, y_ref) < 0.1
    # include / exclude rules, on module paths
    only_mlp = mxl.quantize_model(model, MX, include="*mlp*")
    assert count_jaxmx_gemms(lambda p: only_mlp.apply(p, tokens), params) == 2 * 2
    everything = mxl.quantize_model(model, MX, exclude_defaults=False)
    assert count_jaxmx_gemms(lambda p: everything.apply(p, tokens), params) == 2 * 6 + 1
    with pytest.raises(
        ValueError, match=r"include pattern\(s\) \['decoder'\] match no convertible"
    ):
        mxl.quantize_model(model, MX, include=["*mlp*", "decoder"]).apply(params, tokens)
    # attention=True: the two attention products of each block too
    with_attention = mxl.quantize_model(model, MX, attention=True)
    assert count_jaxmx_gemms(lambda p: with_attention.apply(p, tokens), params) == 2 * (6 + 2)
    y_attn = with_attention.apply(params, tokens)
    assert 1e-3 < _rel(y_attn, y) < 0.1


def test_quantized_transformer_lm_trains_like_high_precision():
    model = TransformerLM()
    batch = lm_batch()
    inputs, targets = batch[:, :-1], batch[:, 1:]
    params = model.init(jax.random.key(0), inputs)
    opt = optax.adam(1e-3)

    def train(m):
        def loss_fn(p):
            logits = m.apply(p, inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        @jax.jit
        def step(p, s):
            loss, grads = jax.value_and_grad(loss_fn)(p)
            updates, s = opt.update(grads, s, p)
            return optax.apply_updates(p, updates), s, loss

        p, s, losses = params, opt.init(params), []
        for _ in range(6):
            p, s, loss = step(p, s)
            losses.append(float(loss))
        return np.array(losses)

    ref = train(model)
    assert ref[-1] < 0.9 * ref[0]  # it learns
    for attention in (False, True):
        mx = train(mxl.quantize_model(model, MX, attention=attention))
        np.testing.assert_allclose(mx, ref, rtol=0.01)


def test_the_documented_linen_attention_hooks():
    """Flax's own attention layer with every GEMM hook given a jaxmx callable."""
    from jaxmx.flax import MXAttention, MXDotGeneral, MXEinsum

    x = jax.random.normal(jax.random.key(2), (2, 8, 64))

    def gemms(layer) -> int:
        params = layer.init(jax.random.key(0), x)
        return str(jax.make_jaxpr(lambda p: layer.apply(p, x))(params)).count("custom_vjp_call")

    hooks = dict(
        qkv_dot_general_cls=lambda: MXDotGeneral(MX),
        out_dot_general_cls=lambda: MXDotGeneral(MX),
        qk_attn_weights_einsum_cls=lambda: MXEinsum(MX),
        attn_weights_value_einsum_cls=lambda: MXEinsum(MX),
    )
    assert gemms(nn.MultiHeadDotProductAttention(4, **hooks)) == 6
    as_fn = dict(qkv_dot_general=MXDotGeneral(MX), out_dot_general=MXDotGeneral(MX))
    assert gemms(nn.MultiHeadDotProductAttention(4, attention_fn=MXAttention(MX), **as_fn)) == 6
    assert gemms(nn.Dense(8, dot_general_cls=lambda: MXDotGeneral(MX))) == 1


# --- per-layer precision: keep / keep_last / keep_recipe ---------------------------------------

E5M2 = jaxmx.recipes.Recipe(fwd="mxfp8_e5m2", grad="mxfp8_e5m2")


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(64, name="down")(nn.Dense(64, name="up")(x))


class Stack(nn.Module):
    """Three numbered blocks (``block_0`` .. ``block_2``, two Dense layers each) and a head."""

    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = Block(name=f"block_{i}")(x)
        return nn.Dense(16, name="head")(x)


def _linen_behaviour(quantized, params, x) -> dict[str, str]:
    """Which of plain high precision, MXFP8 E4M3 and MXFP8 E5M2 each Dense layer of ``Stack``
    computes, from its captured input and output: ``x @ kernel + bias`` in numpy, or the MX
    products of the operands quantized by the independent reference."""

    def mx(h, w, fmt):
        q = [mxref.quantize(a, fmt, "rceil", axis=ax) for a, ax in ((h, -1), (w, 0))]
        return mxref.dequantize(*q[0], -1, h.shape) @ mxref.dequantize(*q[1], 0, w.shape)

    _, state = quantized.apply(params, x, capture_intermediates=True, mutable=["intermediates"])
    found, h = {}, np.asarray(x)
    for path in [f"block_{i}/{n}" for i in range(3) for n in ("up", "down")] + ["head"]:
        *scope, name = path.split("/")
        layer = params["params"]
        out = state["intermediates"]
        for key in [*scope, name]:
            layer, out = layer[key], out[key]
        y = np.asarray(out["__call__"][0])
        w, b = np.asarray(layer["kernel"]), np.asarray(layer["bias"])
        expected = {"plain": h @ w + b, "e4m3": mx(h, w, "mxfp8_e4m3") + b}
        expected["e5m2"] = mx(h, w, "mxfp8_e5m2") + b
        kinds = [k for k, ref in expected.items() if np.allclose(y, ref, rtol=1e-5, atol=1e-5)]
        assert len(kinds) == 1, (path, kinds)
        found[path], h = kinds[0], y
    return found


def test_quantize_model_keep_last_and_keep():
    x = jax.random.normal(jax.random.key(2), (4, 64))
    params = Stack().init(jax.random.key(0), x)
    kept = mxl.quantize_model(Stack(), MX, keep_last=1)
    jax.tree.map(np.testing.assert_array_equal, kept.init(jax.random.key(0), x), params)
    assert _linen_behaviour(kept, params, x) == {
        "block_0/up": "e4m3",
        "block_0/down": "e4m3",
        "block_1/up": "e4m3",
        "block_1/down": "e4m3",
        "block_2/up": "plain",
        "block_2/down": "plain",
        "head": "plain",  # excluded by default
    }
    # under a trace too (the blocks are found by an abstract pass inside it)
    assert count_jaxmx_gemms(lambda p: kept.apply(p, x), params) == 4
    both = mxl.quantize_model(Stack(), MX, keep_last=2, keep="block_0/up", keep_recipe=E5M2)
    assert _linen_behaviour(both, params, x) == {
        "block_0/up": "e5m2",
        "block_0/down": "e4m3",
        "block_1/up": "e5m2",
        "block_1/down": "e5m2",
        "block_2/up": "e5m2",
        "block_2/down": "e5m2",
        "head": "plain",
    }


def test_quantize_model_keep_errors():
    x = jnp.ones((4, 64))
    params = Stack().init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"keep_last must be an integer >= 0 .*got -2"):
        mxl.quantize_model(Stack(), MX, keep_last=-2)
    with pytest.raises(TypeError, match=r"keep_recipe must be a jaxmx\.Recipe .* got 'bf16'"):
        mxl.quantize_model(Stack(), MX, keep_recipe="bf16")
    with pytest.raises(
        ValueError,
        match=r"keep_last=4 is more than the 3 numbered blocks under 'block_' "
        r"\(block_0 \.\. block_2\)",
    ):
        mxl.quantize_model(Stack(), MX, keep_last=4).apply(params, x)
    with pytest.raises(ValueError, match=r"keep pattern\(s\) \['block_3'\] match no converted"):
        mxl.quantize_model(Stack(), MX, keep="block_3").apply(params, x)
    # TransformerLM's layers are named block_0_attn, block_0_mlp_up, ...: no numbered blocks
    tokens = lm_batch()[:, :-1]
    lm_params = TransformerLM().init(jax.random.key(0), tokens)
    with pytest.raises(ValueError, match=r"keep_last=1 needs numbered blocks .*'block_0_attn/"):
        mxl.quantize_model(TransformerLM(), MX, keep_last=1).apply(lm_params, tokens)
