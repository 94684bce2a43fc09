"""The model-conversion contract of both Flax APIs: a converted linen module carries its
conversion in what it compares and hashes on and stays converted however it is used; both
converters report every layer; default exclusions hold on real model shapes; include / exclude
mean what docs/flax.md says; an option that matches nothing is reported."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmx

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
import jaxmx.flax.linen as mxl  # noqa: E402
import jaxmx.flax.nnx as mxnnx  # noqa: E402

MX = jaxmx.recipes.MXFP8
NVFP4 = jaxmx.recipes.NVFP4


def jaxmx_gemms(fn, *args) -> int:
    """The number of jaxmx GEMMs (custom-VJP calls) in ``fn``'s program."""
    return str(jax.make_jaxpr(fn)(*args)).count("custom_vjp_call")


# --- linen: a model in the style of Flax's lm1b example -------------------------------------


class Lm1bDecoder(nn.Module):
    """lm1b's decoder layout: embed, numbered blocks, and an output projection named
    ``logitdense``."""

    vocab: int = 32
    width: int = 32

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width, name="embed")(tokens)
        for i in range(2):
            h = nn.Dense(2 * self.width, name=f"up_{i}")(x)
            x = x + nn.Dense(self.width, name=f"down_{i}")(nn.gelu(h))
        return nn.Dense(self.vocab, name="logitdense")(x)


TOKENS = (jnp.arange(24).reshape(4, 6) * 7) % 32


@pytest.fixture(scope="module")
def lm_params():
    return Lm1bDecoder().init(jax.random.key(0), TOKENS)


def test_linen_conversions_compare_and_hash_by_what_they_compute(lm_params):
    mx, mx_again = mxl.quantize_model(Lm1bDecoder(), MX), mxl.quantize_model(Lm1bDecoder(), MX)
    fp4, off = mxl.quantize_model(Lm1bDecoder(), NVFP4), mxl.quantize_model(Lm1bDecoder(), None)
    assert mx == mx_again and hash(mx) == hash(mx_again)
    assert len({mx, fp4, off, mxl.quantize_model(Lm1bDecoder(), MX, keep_last=1)}) == 4
    assert mx != Lm1bDecoder()

    # The usual Flax jit: the model as a static argument. Each conversion computes its own.
    @functools.partial(jax.jit, static_argnums=0)
    def run(model, params):
        return model.apply(params, TOKENS)

    ys = {
        name: np.asarray(run(m, lm_params)) for name, m in [("mx", mx), ("fp4", fp4), ("off", off)]
    }
    assert not np.array_equal(ys["mx"], ys["fp4"]) and not np.array_equal(ys["mx"], ys["off"])
    np.testing.assert_array_equal(ys["mx"], run(mx_again, lm_params))  # one entry for equals
    assert run._cache_size() == 3
    np.testing.assert_array_equal(ys["off"], run(Lm1bDecoder(), lm_params))


def test_linen_conversion_holds_however_the_module_is_used(lm_params):
    mx = mxl.quantize_model(Lm1bDecoder(), MX)
    want = np.asarray(mx.apply(lm_params, TOKENS))
    assert jaxmx_gemms(lambda p: mx.apply(p, TOKENS), lm_params) == 4
    bound = mx.bind(lm_params)
    np.testing.assert_array_equal(bound(TOKENS), want)
    for copy in (mx.clone(), mx.copy()):
        np.testing.assert_array_equal(copy.apply(lm_params, TOKENS), want)

    class Compact(nn.Module):  # created inside a compact method
        @nn.compact
        def __call__(self, tokens):
            return mxl.quantize_model(Lm1bDecoder(), MX)(tokens)

    class Field(nn.Module):  # a field of another module
        lm: nn.Module

        def __call__(self, tokens):
            return self.lm(tokens)

    class Setup(nn.Module):  # assigned in setup
        def setup(self):
            self.lm = mx

        def __call__(self, tokens):
            return self.lm(tokens)

    for outer in (Compact(), Field(mx), Setup()):
        (name,) = outer.init(jax.random.key(0), TOKENS)["params"]
        params = {"params": {name: lm_params["params"]}}
        np.testing.assert_array_equal(outer.apply(params, TOKENS), want)
        assert jaxmx_gemms(lambda p, o=outer: o.apply(p, TOKENS), params) == 4

    # under a lifted transform around the converted submodule
    remat = nn.remat(Setup)()
    np.testing.assert_array_equal(
        remat.apply({"params": {"lm": lm_params["params"]}}, TOKENS), want
    )
    # nn.tabulate sees the stock model's table (the planning pass adds no rows)
    table, stock = nn.tabulate(mx, jax.random.key(0)), nn.tabulate(Lm1bDecoder(), jax.random.key(0))
    assert table(TOKENS) == stock(TOKENS)


class ScannedBlocks(nn.Module):
    """Blocks through ``nn.scan`` and ``nn.remat``, and a ``nn.vmap`` over the batch."""

    @nn.compact
    def __call__(self, x):
        class Block(nn.Module):
            @nn.compact
            def __call__(self, h, _):
                return h + nn.Dense(32, name="mlp")(h), None

        scan = nn.scan(
            nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=2
        )
        x, _ = scan(name="blocks")(x, None)
        per_row = nn.vmap(
            nn.Dense,
            in_axes=0,
            out_axes=0,
            variable_axes={"params": None},
            split_rngs={"params": False},
        )
        return per_row(16, name="proj")(x)


def test_linen_conversion_reaches_layers_inside_lifted_transforms():
    x = jax.random.normal(jax.random.key(1), (4, 32))
    model = ScannedBlocks()
    params = model.init(jax.random.key(0), x)
    mx = mxl.quantize_model(model, MX)
    assert jaxmx_gemms(lambda p: mx.apply(p, x), params) == 2  # the scanned body once, proj
    report = mxl.conversion_report(mx, x)
    assert {p: r.reason for p, r in report.items()} == {
        "blocks/mlp": "converted",
        "proj": "converted",
    }
    y = mx.apply(params, x)
    assert 1e-3 < float(jnp.linalg.norm(y - model.apply(params, x)) / jnp.linalg.norm(y)) < 0.1


# --- what is converted by default -------------------------------------------------------------


def test_linen_default_exclusions_and_report(lm_params):
    mx = mxl.quantize_model(Lm1bDecoder(), NVFP4, keep_last=1)
    report = mxl.conversion_report(mx, TOKENS)
    assert {p: (r.recipe, r.reason) for p, r in report.items()} == {
        "embed": (None, "embedding table: high precision (never converted)"),
        "up_0": (NVFP4, "converted"),
        "down_0": (NVFP4, "converted"),
        "up_1": (None, "kept: one of the last 1 blocks of 'up_'"),
        "down_1": (None, "kept: one of the last 1 blocks of 'down_'"),
        "logitdense": (None, "excluded by default: '*logit*'"),
    }
    assert list(report.converted) == ["up_0", "down_0", "up_1", "down_1"]
    assert all(isinstance(r, mxl.LayerPlan) for r in report.values())
    assert "logitdense  Dense  high precision  excluded by default: '*logit*'" in str(report)


class NamelessHead(nn.Module):
    """An output projection to the vocabulary named like any other layer; tied embeddings."""

    tied: bool = False

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(32, 16, name="tok")
        x = nn.Dense(16, name="proj")(embed(tokens))
        return embed.attend(x) if self.tied else nn.Dense(32, name="out")(x)


def test_the_output_head_is_excluded_by_position():
    for tied, expected in ((False, ["proj"]), (True, ["proj"])):
        model = mxl.quantize_model(NamelessHead(tied=tied), MX)
        report = mxl.conversion_report(model, TOKENS)
        assert list(report.converted) == expected
    assert mxl.conversion_report(mxl.quantize_model(NamelessHead(), MX), TOKENS)["out"].reason == (
        "excluded by default: output head (the last projection; its width is the size of an "
        "embedding table)"
    )
    # include naming it wins over the default; exclude_defaults=False lifts the defaults
    named = mxl.quantize_model(NamelessHead(), MX, include=["proj", "out"])
    assert list(mxl.conversion_report(named, TOKENS).converted) == ["proj", "out"]
    every = mxl.quantize_model(NamelessHead(), MX, exclude_defaults=False)
    assert list(mxl.conversion_report(every, TOKENS).converted) == ["proj", "out"]


def test_nnx_output_head_is_excluded_by_position():
    class Net(nnx.Module):
        def __init__(self, rngs, vocab=32):
            self.tok = nnx.Embed(vocab, 16, rngs=rngs)
            self.proj = nnx.Linear(16, 16, rngs=rngs)
            self.out = nnx.Linear(16, vocab, rngs=rngs)

    report = mxnnx.quantize_model(Net(nnx.Rngs(0)), MX)
    assert list(report.converted) == ["proj"]
    assert report["out"].reason.startswith("excluded by default: output head")
    # nnx has no call order: with two projections to the vocabulary neither is the head
    net = Net(nnx.Rngs(0))
    net.proj = nnx.Linear(16, 32, rngs=nnx.Rngs(1))
    assert sorted(mxnnx.quantize_model(net, MX).converted) == ["out", "proj"]


class NnxMoE(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.attn = nnx.Module()
        self.attn.query = nnx.Linear(16, 16, rngs=rngs)
        self.attn.key = nnx.Linear(16, 16, rngs=rngs)
        self.router = nnx.Linear(16, 4, rngs=rngs)
        self.gate = nnx.Linear(16, 4, rngs=rngs)  # DeepSeek's name for the router
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.logitdense = nnx.Linear(64, 32, rngs=rngs)


def test_nnx_default_exclusions_and_report():
    report = mxnnx.quantize_model(NnxMoE(nnx.Rngs(0)), MX)
    assert isinstance(report, mxnnx.ConversionReport)
    assert {p: r.reason for p, r in report.items()} == {
        "embed": "embedding table: high precision (never converted)",
        "attn/query": "converted",
        "attn/key": "converted",
        "router": "excluded by default: '*router*'",
        "gate": "excluded by default: 'gate'",
        "up": "converted",
        "logitdense": "excluded by default: '*logit*'",
    }
    assert report["up"].layer.dot_general == jaxmx.flax.MXDotGeneral(MX, "up")
    assert report["router"].layer.dot_general is jax.lax.dot_general


# --- include / exclude ------------------------------------------------------------------------


def converted(**kw) -> list[str]:
    return sorted(mxnnx.quantize_model(NnxMoE(nnx.Rngs(0)), MX, **kw).converted)


def test_include_exclude_rules():
    # an exclude adds to the defaults
    assert converted(exclude="up") == ["attn/key", "attn/query"]
    # patterns match a run of components at any depth
    assert converted(exclude="attn/*") == ["up"]
    assert converted(include="attn/q*") == ["attn/query"]
    # an include without wildcards wins over a default exclusion; a wildcard one does not
    assert converted(include=["router", "up"]) == ["router", "up"]
    assert converted(include="*r*") == ["attn/query"]
    # the user's exclude wins over everything
    assert converted(include="router", exclude="router") == []
    # predicates
    assert converted(include=lambda path, layer: layer.out_features == 16) == [
        "attn/key",
        "attn/query",
    ]
    assert converted(exclude_defaults=False, exclude=lambda p, layer: p.startswith("attn")) == [
        "gate",
        "logitdense",
        "router",
        "up",
    ]
    with pytest.raises(TypeError, match="include must be None, a pattern"):
        converted(include=3)


def test_options_that_match_nothing_are_reported():
    with pytest.raises(
        ValueError, match=r"include pattern\(s\) \['decoder', '\*mlp\*'\] match no convertible"
    ):
        converted(include=["up", "decoder", "*mlp*"])
    with pytest.warns(UserWarning, match=r"exclude pattern\(s\) \['uup'\] match no convertible"):
        assert converted(exclude=["uup"]) == ["attn/key", "attn/query", "up"]
    with pytest.warns(UserWarning, match="attention=True, but the model has no Flax attention"):
        converted(attention=True)
    with pytest.raises(ValueError, match=r"keep pattern\(s\) \['head', 'x'\] match no converted"):
        converted(keep=["up", "head", "x"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted(exclude="up", attention=False)  # a pattern that matches: no warning


def test_linen_options_that_match_nothing_are_reported(lm_params):
    with pytest.warns(UserWarning, match="attention=True, but the model has no Flax attention"):
        mxl.quantize_model(Lm1bDecoder(), MX, attention=True).apply(lm_params, TOKENS)
    with pytest.warns(UserWarning, match=r"exclude pattern\(s\) \['lgits'\]"):
        mxl.quantize_model(Lm1bDecoder(), MX, exclude="lgits").apply(lm_params, TOKENS)


# --- mixture of experts -----------------------------------------------------------------------


class NnxExperts(nnx.Module):
    """The docs' top-1 MoE layout: a router, and experts through one MXRaggedDot."""

    def __init__(self, rngs, width=32, experts=3):
        self.router = nnx.Linear(width, experts, rngs=rngs)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (experts, width, width)) * 0.2)
        self.ragged_dot = jaxmx.flax.MXRaggedDot()

    def __call__(self, x):
        expert = jnp.argmax(self.router(x), axis=-1)
        order = jnp.argsort(expert)
        sizes = jnp.bincount(expert, length=self.w.shape[0])
        y = self.ragged_dot(x[order], self.w[...], sizes)
        return jnp.zeros_like(y).at[order].set(y)


class NnxMoEModel(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([NnxExperts(rngs) for _ in range(2)])

    def __call__(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


X = jax.random.normal(jax.random.key(5), (16, 32))


def test_nnx_conversion_reaches_the_experts():
    model, ref = NnxMoEModel(nnx.Rngs(0)), NnxMoEModel(nnx.Rngs(0))
    report = mxnnx.quantize_model(model, NVFP4, keep_last=1)
    assert {p: (r.kind, r.recipe, r.reason) for p, r in report.items()} == {
        "blocks/0": ("NnxExperts", NVFP4, "converted"),
        "blocks/0/router": ("Linear", None, "excluded by default: '*router*'"),
        "blocks/1": ("NnxExperts", None, "kept: one of the last 1 blocks of 'blocks/'"),
        "blocks/1/router": ("Linear", None, "excluded by default: '*router*'"),
    }
    assert model.blocks[0].ragged_dot == jaxmx.flax.MXRaggedDot(NVFP4, "blocks/0")
    # the converted model computes what experts built with NVFP4 / high precision compute
    ref.blocks[0].ragged_dot = jaxmx.flax.MXRaggedDot(NVFP4)
    ref.blocks[1].ragged_dot = jaxmx.flax.MXRaggedDot(None)
    np.testing.assert_array_equal(model(X), ref(X))
    assert not np.array_equal(model(X), NnxMoEModel(nnx.Rngs(0))(X))  # not MXFP8 any more


class LinenExperts(nn.Module):
    ragged_dot: object = jaxmx.flax.MXRaggedDot()

    @nn.compact
    def __call__(self, x):
        expert = jnp.argmax(nn.Dense(3, name="router")(x), axis=-1)
        w = self.param("w", nn.initializers.normal(0.2), (3, 32, 32))
        order = jnp.argsort(expert)
        y = self.ragged_dot(x[order], w, jnp.bincount(expert, length=3))
        return jnp.zeros_like(y).at[order].set(y)


def test_linen_conversion_reaches_the_experts():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + LinenExperts(name="moe")(x)

    params = Model().init(jax.random.key(0), X)
    mx = mxl.quantize_model(Model(), NVFP4)
    report = mxl.conversion_report(mx, X)
    assert [(p, r.reason) for p, r in report.items()] == [  # in call order
        ("moe", "converted"),
        ("moe/router", "excluded by default: '*router*'"),
    ]
    want = LinenExperts(jaxmx.flax.MXRaggedDot(NVFP4)).apply({"params": params["params"]["moe"]}, X)
    np.testing.assert_array_equal(mx.apply(params, X), X + want)
