"""jaxmx.flax.nnx: Linear, Einsum and quantize_model against flax.nnx."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as mxref
from flax import nnx

import jaxmx
import jaxmx.flax.nnx as mxnnx

MX = jaxmx.recipes.MXFP8


def _q(a, axis, fmt="mxfp8_e4m3"):
    """``a`` quantized to ``fmt`` (rceil, blocks of 32 along ``axis``) and dequantized in
    float64 by the independent reference in tests/reference.py."""
    a = np.asarray(a, np.float32)
    data, scale = mxref.quantize(a, fmt, "rceil", axis=axis)
    return mxref.dequantize(data, scale, axis, a.shape)


def _rel(a, b):
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(1), (4, 8, 64), jnp.float32)


def _pairs():
    """(jaxmx layer factory, flax layer factory, float64 MX reference of the flax layer's math)."""
    lin = dict(in_features=64, out_features=48)
    ein = dict(einsum_str="btd,dnh->btnh", kernel_shape=(64, 3, 16), bias_shape=(3, 16))
    return {
        "Linear": (
            lambda **kw: mxnnx.Linear(**lin, rngs=nnx.Rngs(0), **kw),
            lambda: nnx.Linear(**lin, rngs=nnx.Rngs(0)),
            lambda m, x: _q(x, -1) @ _q(m.kernel[...], 0) + np.asarray(m.bias[...]),
        ),
        "Einsum": (
            lambda **kw: mxnnx.Einsum(**ein, rngs=nnx.Rngs(0), **kw),
            lambda: nnx.Einsum(**ein, rngs=nnx.Rngs(0)),
            lambda m, x: (
                np.einsum("btd,dnh->btnh", _q(x, -1), _q(m.kernel[...], 0))
                + np.asarray(m.bias[...])
            ),
        ),
    }


@pytest.mark.parametrize("name", ["Linear", "Einsum"])
def test_recipe_none_matches_flax_exactly(name, x):
    make, make_ref, _ = _pairs()[name]
    mine, ref = make(recipe=None), make_ref()
    jax.tree.map(np.testing.assert_array_equal, nnx.state(mine), nnx.state(ref))
    np.testing.assert_array_equal(mine(x), ref(x))


@pytest.mark.parametrize("name", ["Linear", "Einsum"])
def test_mx_matches_mx_definition_and_flax_closely(name, x):
    make, make_ref, mx_ref = _pairs()[name]
    mine, ref = make(), make_ref()
    assert mine.recipe == MX
    y = mine(x)
    err = _rel(y, ref(x))
    assert 1e-3 < err < 0.05, err
    np.testing.assert_allclose(y, mx_ref(ref, x), rtol=1e-5, atol=1e-5)


def test_params_keep_user_dtype(x):
    layer = mxnnx.Linear(64, 16, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert {p.dtype for p in jax.tree.leaves(nnx.state(layer))} == {jnp.dtype(jnp.bfloat16)}
    assert layer(x).dtype == jnp.bfloat16
    assert mxnnx.Linear(64, 16, rngs=nnx.Rngs(0)).kernel.dtype == jnp.float32


def test_gradients_flow_and_match_high_precision(x):
    mine, ref = mxnnx.Linear(64, 32, rngs=nnx.Rngs(0)), nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    target = jax.random.normal(jax.random.key(2), (4, 8, 32))

    def loss(m, x):
        return jnp.mean((m(x) - target) ** 2)

    g, gx = nnx.grad(loss, argnums=(0, 1))(mine, x)
    g_ref, gx_ref = nnx.grad(loss, argnums=(0, 1))(ref, x)
    for a, b in zip(jax.tree.leaves((g, gx)), jax.tree.leaves((g_ref, gx_ref)), strict=True):
        assert bool(jnp.all(jnp.isfinite(a))) and float(jnp.abs(a).max()) > 0
        assert 0 < _rel(a, b) < 0.1


class Net(nnx.Module):
    """Embedding, two MLP layers, an einsum projection and an output head."""

    def __init__(self, rngs, vocab=16, d=64):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(d, d, rngs=rngs) for _ in range(2)])
        self.proj = nnx.Einsum("btd,de->bte", (d, d), rngs=rngs)
        self.lm_head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        for layer in self.blocks:
            h = h + jax.nn.gelu(layer(h))
        return self.lm_head(self.proj(h))


@pytest.fixture(scope="module")
def tokens():
    """Sequences where each token determines the next: t' = (5 t + 3) mod 16."""
    first = jax.random.randint(jax.random.key(3), (8,), 0, 16)
    seq = [first]
    for _ in range(31):
        seq.append((5 * seq[-1] + 3) % 16)
    return jnp.stack(seq, axis=1)


def test_quantize_model_default_keeps_embed_and_head(tokens):
    model, ref = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    state = nnx.state(model)
    report = mxnnx.quantize_model(model, MX)
    assert list(report.converted) == ["blocks/0", "blocks/1", "proj"]
    assert list(report) == ["blocks/0", "blocks/1", "embed", "lm_head", "proj"]
    assert report["proj"].layer is model.proj and report["blocks/0"].recipe == MX
    assert isinstance(model.lm_head.dot_general, type(jax.lax.dot_general))  # untouched
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model), state)  # params untouched
    y, y_ref = model(tokens), ref(tokens)
    assert 1e-3 < _rel(y, y_ref) < 0.05
    # The converted layers compute what jaxmx layers with the same parameters compute.
    h = model.embed(tokens)
    lin = mxnnx.Linear(64, 64, rngs=nnx.Rngs(0))
    nnx.update(lin, nnx.state(model.blocks[0]))
    np.testing.assert_array_equal(model.blocks[0](h), lin(h))
    # recipe=None converts back to high precision, exactly.
    assert len(mxnnx.quantize_model(model, None).converted) == 3
    np.testing.assert_array_equal(model(tokens), y_ref)


def test_quantize_model_include_exclude_rules():
    def paths(**kw):
        return sorted(mxnnx.quantize_model(Net(nnx.Rngs(0)), MX, **kw).converted)

    assert paths(exclude_defaults=False) == ["blocks/0", "blocks/1", "lm_head", "proj"]
    assert paths(include="blocks/*") == ["blocks/0", "blocks/1"]
    assert paths(include=["proj", "*head"]) == ["proj"]  # a wildcard: the default still applies
    assert paths(include=["proj", "lm_head"]) == ["lm_head", "proj"]  # naming it wins
    # A pattern matches a run of path components; exclude= adds to the defaults.
    assert paths(exclude=["1", "proj"]) == ["blocks/0"]
    assert paths(exclude=["1", "proj"], exclude_defaults=False) == ["blocks/0", "lm_head"]
    assert paths(include=lambda path, layer: isinstance(layer, nnx.Einsum)) == ["proj"]
    assert paths(exclude=lambda path, layer: layer.kernel.shape[1] != 64) == [
        "blocks/0",
        "blocks/1",
        "proj",
    ]
    assert mxnnx.quantize_model(Net(nnx.Rngs(0)))["proj"].recipe == MX  # default recipe
    model = Net(nnx.Rngs(0))
    mxnnx.quantize_model(model)
    assert model.proj.einsum_op == jaxmx.flax.MXEinsum(MX, "proj")


def train_losses(model, tokens, steps: int, lr: float) -> np.ndarray:
    """The losses of ``steps`` jitted Adam steps of next-token prediction on ``tokens``."""
    optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(m):
            logits = m(inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return np.array([float(step(model, optimizer)) for _ in range(steps)])


def test_jitted_optax_training_lowers_loss(tokens):
    model = Net(nnx.Rngs(0))
    mxnnx.quantize_model(model, MX)
    losses = train_losses(model, tokens, 30, 1e-2)
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.2 * losses[0], losses
    assert model.blocks[0].kernel.dtype == jnp.float32


def test_checkpoint_roundtrip(tokens, tmp_path):
    import orbax.checkpoint as ocp

    model = Net(nnx.Rngs(0))
    mxnnx.quantize_model(model, MX)
    nnx.update(model, jax.tree.map(lambda p: p + 0.01, nnx.state(model, nnx.Param)))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", nnx.state(model))
    ckpt.wait_until_finished()

    fresh = Net(nnx.Rngs(7))
    mxnnx.quantize_model(fresh, MX)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: fresh))
    restored = nnx.merge(graphdef, ckpt.restore(tmp_path / "ckpt", abstract))
    jax.tree.map(np.testing.assert_array_equal, nnx.state(restored), nnx.state(model))
    np.testing.assert_array_equal(restored(tokens), model(tokens))
    assert restored.blocks[0].dot_general.recipe == MX


def test_stochastic_gradient_rounding_takes_keys_from_the_block():
    recipe = jaxmx.recipes.MXFP8.replace(backend="emulate", grad_rounding="stochastic")
    layer = mxnnx.Linear(64, 32, recipe=recipe, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (16, 64))

    @nnx.jit
    def grads(layer, x, key):
        def loss(layer):
            return jnp.sum(jnp.sin(layer(x)))

        with jaxmx.stochastic_rounding(key):
            return nnx.grad(loss)(layer).kernel[...]

    g0, g0_again, g1 = (grads(layer, x, jax.random.key(k)) for k in (0, 0, 1))
    np.testing.assert_array_equal(g0, g0_again)
    assert not np.array_equal(g0, g1)
    # unbiased noise around the round-to-nearest gradient: the two draws are close to each other
    np.testing.assert_allclose(g0, g1, rtol=0.2, atol=0.05 * float(jnp.abs(g0).max()))
    with pytest.raises(ValueError, match="stochastic_rounding"):
        nnx.grad(lambda layer: jnp.sum(layer(x)))(layer)


class AttentionBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(4, 64, decode=False, rngs=rngs)
        self.general = nnx.LinearGeneral(64, (2, 32), rngs=rngs)

    def __call__(self, x):
        h = self.attn(x)
        return self.general(h).reshape(h.shape)


def test_quantize_model_converts_attention_projections_and_linear_general(x):
    model, ref = AttentionBlock(nnx.Rngs(0)), AttentionBlock(nnx.Rngs(0))
    converted = mxnnx.quantize_model(model, MX).converted
    assert sorted(converted) == [
        "attn/key",
        "attn/out",
        "attn/query",
        "attn/value",
        "general",
    ]
    for plan in converted.values():
        layer = plan.layer
        assert isinstance(layer.dot_general, jaxmx.flax.MXDotGeneral)
        assert layer.dot_general.recipe == MX
    y, y_ref = model(x), ref(x)
    assert 1e-3 < _rel(y, y_ref) < 0.15  # quantized: three MXFP8 GEMMs deep
    # The query projection computes what the MX reference says: x and the kernel, each
    # quantized along the contraction (d), then a float64 product.
    q = model.attn.query
    want = np.einsum("btd,dnh->btnh", _q(x, -1), _q(q.kernel[...], 0)) + np.asarray(q.bias[...])
    np.testing.assert_allclose(q(x), want, rtol=1e-5, atol=1e-5)


def test_quantize_model_attention_products(x):
    model, ref = AttentionBlock(nnx.Rngs(0)), AttentionBlock(nnx.Rngs(0))
    converted = mxnnx.quantize_model(model, MX, attention=True).converted
    assert "attn" in converted and isinstance(model.attn.attention_fn, jaxmx.flax.MXAttention)
    assert len(converted) == 6
    graph = str(jax.make_jaxpr(lambda x: model(x))(x))
    assert graph.count("custom_vjp_call") == 4 + 1 + 2  # projections, general, QK^T and PV
    assert 1e-3 < _rel(model(x), ref(x)) < 0.15


def test_quantize_model_include_that_matches_nothing_raises():
    with pytest.raises(
        ValueError, match=r"include pattern\(s\) \['\*query\*'\] match no .*'blocks/0'"
    ):
        mxnnx.quantize_model(Net(nnx.Rngs(0)), MX, include=["blocks/*", "*query*"])


def test_quantize_model_refuses_a_layer_with_dot_general_cls():
    class Custom(nnx.Module):
        def __init__(self, rngs):
            self.proj = nnx.LinearGeneral(
                32, 32, dot_general_cls=lambda: jax.lax.dot_general, rngs=rngs
            )

    with pytest.raises(ValueError, match="'proj' sets dot_general_cls"):
        mxnnx.quantize_model(Custom(nnx.Rngs(0)), MX)


class TinyLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(16, 64, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, 64, decode=False, rngs=rngs)
        self.up = nnx.Linear(64, 128, rngs=rngs)
        self.down = nnx.Linear(128, 64, rngs=rngs)
        self.head = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(x, mask=nnx.make_causal_mask(tokens))
        x = x + self.down(jax.nn.gelu(self.up(x)))
        return self.head(x)


@pytest.mark.parametrize("attention", [False, True])
def test_quantized_attention_model_trains_like_high_precision(tokens, attention):
    def train(convert):
        model = TinyLM(nnx.Rngs(0))
        if convert:
            mxnnx.quantize_model(model, MX, attention=attention)
        return train_losses(model, tokens, 6, 1e-3)

    ref, mx = train(False), train(True)
    assert ref[-1] < 0.95 * ref[0]  # it learns
    np.testing.assert_allclose(mx, ref, rtol=0.01)


# --- per-layer precision: keep / keep_last / keep_recipe ---------------------------------------

E5M2 = jaxmx.recipes.Recipe(fwd="mxfp8_e5m2", grad="mxfp8_e5m2")


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.up = nnx.Linear(d, d, rngs=rngs)
        self.down = nnx.Linear(d, d, rngs=rngs)


class Encoder(nnx.Module):
    def __init__(self, d, rngs):
        self.layers_0 = nnx.Linear(d, d, rngs=rngs)
        self.layers_1 = nnx.Linear(d, d, rngs=rngs)


class Stacks(nnx.Module):
    """Two stacks of numbered blocks (``encoder/layers_0..1``, ``blocks/0..2``) and two layers
    outside them (``proj``, and ``head``, excluded by default)."""

    def __init__(self, rngs, d=64):
        self.encoder = Encoder(d, rngs)
        self.blocks = nnx.List([Block(d, rngs) for _ in range(3)])
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.head = nnx.Linear(d, 16, rngs=rngs)


def _computes(layer, stock, x) -> str:
    """Which of plain high precision, MXFP8 E4M3 and MXFP8 E5M2 ``layer`` computes on ``x``: the
    stock layer with the same parameters, or the float64 references of the MX products."""
    w, b = np.asarray(stock.kernel[...]), np.asarray(stock.bias[...])
    expected = {
        "plain": np.asarray(stock(x)),
        "e4m3": _q(x, -1) @ _q(w, 0) + b,
        "e5m2": _q(x, -1, "mxfp8_e5m2") @ _q(w, 0, "mxfp8_e5m2") + b,
    }
    y = np.asarray(layer(x))
    found = [k for k, ref in expected.items() if np.allclose(y, ref, rtol=1e-5, atol=1e-5)]
    assert len(found) == 1, found
    return found[0]


def _behaviour(model, converted, x):
    stock = {"/".join(map(str, p)): m for p, m in nnx.iter_modules(Stacks(nnx.Rngs(0)))}
    assert _computes(model.head, stock["head"], x) == "plain"  # excluded: untouched
    return {path: _computes(p.layer, stock[path], x) for path, p in converted.converted.items()}


def test_quantize_model_keep_last_keeps_the_final_blocks_of_each_stack():
    x = jax.random.normal(jax.random.key(2), (4, 64))
    model = Stacks(nnx.Rngs(0))
    converted = mxnnx.quantize_model(model, MX, keep_last=1)
    expected = {
        "encoder/layers_0": "e4m3",
        "encoder/layers_1": "plain",
        "blocks/0/up": "e4m3",
        "blocks/0/down": "e4m3",
        "blocks/1/up": "e4m3",
        "blocks/1/down": "e4m3",
        "blocks/2/up": "plain",
        "blocks/2/down": "plain",
        "proj": "e4m3",  # outside the numbered blocks: keep_last does not touch it
    }
    assert _behaviour(model, converted, x) == expected
    # the report says what each layer got
    recipes = {path: plan.recipe for path, plan in converted.converted.items()}
    assert recipes == {p: MX if k == "e4m3" else None for p, k in expected.items()}


def test_quantize_model_keep_rules_and_keep_recipe():
    x = jax.random.normal(jax.random.key(2), (4, 64))
    model = Stacks(nnx.Rngs(0))
    converted = mxnnx.quantize_model(model, MX, keep_last=2, keep="proj", keep_recipe=E5M2)
    assert _behaviour(model, converted, x) == {
        "encoder/layers_0": "e5m2",  # the last 2 of a stack of 2
        "encoder/layers_1": "e5m2",
        "blocks/0/up": "e4m3",
        "blocks/0/down": "e4m3",
        "blocks/1/up": "e5m2",
        "blocks/1/down": "e5m2",
        "blocks/2/up": "e5m2",
        "blocks/2/down": "e5m2",
        "proj": "e5m2",  # keep=
    }
    # keep alone (a predicate), and keep_last counted among the converted layers only
    model = Stacks(nnx.Rngs(0))
    converted = mxnnx.quantize_model(
        model, MX, include="blocks/*", keep=lambda path, layer: path.endswith("0/up"), keep_last=1
    )
    assert _behaviour(model, converted, x) == {
        "blocks/0/up": "plain",
        "blocks/0/down": "e4m3",
        "blocks/1/up": "e4m3",
        "blocks/1/down": "e4m3",
        "blocks/2/up": "plain",
        "blocks/2/down": "plain",
    }


@pytest.mark.parametrize(
    ("path", "block"),
    [
        ("blocks/3/mlp/up", ("blocks/", 3)),
        ("layers_3/attn/query", ("layers_", 3)),
        ("block_3", ("block_", 3)),
        ("decoder/layers_12/mlp/layers_0", ("decoder/layers_", 12)),  # the first numbered one
        ("0/up", ("", 0)),
        ("block_0_attn/query", None),
        ("mlp/fc2", None),
        ("head", None),
    ],
)
def test_block_of(path, block):
    from jaxmx._src.flax.rules import block_of

    assert block_of(path) == block


def test_quantize_model_keep_errors():
    with pytest.raises(ValueError, match=r"keep_last must be an integer >= 0 .*got -1"):
        mxnnx.quantize_model(Stacks(nnx.Rngs(0)), MX, keep_last=-1)
    model = Stacks(nnx.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"keep_last=3 is more than the 2 numbered blocks under 'encoder/layers_' "
        r"\(encoder/layers_0 \.\. encoder/layers_1\)",
    ):
        mxnnx.quantize_model(model, MX, keep_last=3)
    assert model.blocks[0].up.dot_general is jax.lax.dot_general  # nothing converted
    with pytest.raises(
        ValueError,
        match=r"keep_last=1 needs numbered blocks \(a path component "
        r"that is an integer or ends in _<int>.*\['proj'\]",
    ):
        mxnnx.quantize_model(Stacks(nnx.Rngs(0)), MX, include="proj", keep_last=1)
    with pytest.raises(TypeError, match=r"keep_recipe must be a jaxmx\.Recipe .* got 'mxfp8'"):
        mxnnx.quantize_model(Stacks(nnx.Rngs(0)), MX, keep_recipe="mxfp8")
    with pytest.raises(ValueError, match=r"keep pattern\(s\) \['head'\] match no converted"):
        mxnnx.quantize_model(Stacks(nnx.Rngs(0)), MX, keep=["proj", "head"])  # head: excluded
