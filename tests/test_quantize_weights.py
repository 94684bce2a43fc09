"""Weights at rest: ``jaxmx.flax.nnx.quantize_weights`` and ``jaxmx.flax.linen.quantize_weights``.

Numerics are checked against references computed here in float64 (numpy / ml_dtypes via
``tests/reference.py``), never against the code under test: the stored MXFP8 weight against the
reference quantizer, the converted logits against the model computed in float64 with the decoded
weights within an explicit elementwise bound, a converted layer against the original layer in
float64 within the bound its weight's quantization error sets, and the GEMMs against float64
products of their decoded operands.

The bounds: a layer computes ``y = W x + b`` in float32 from its float32 input; the float32
rounding of a K-term dot product and the bias add is at most
``r = (K + 2) 2^-24 (|W| |x| + |b|)`` elementwise. Through the model, an input error ``e``
adds ``|W| e`` (relu is 1-Lipschitz), so the logits' bound is ``e_{l+1} = |W| e_l + r_l``,
propagated layer by layer in float64. A converted layer's output against the original layer's
``W x + b`` also differs by its weight's error, at most ``|x| |W_hat - W|``.
"""

from __future__ import annotations

import math
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import reference as ref
from flax import nnx

import jaxmx
import jaxmx.flax.linen as mxl
import jaxmx.flax.nnx as mxnnx
from jaxmx._src.core.dtypes import to_bits

VOCAB, D = 40, 64
U = 2.0**-24  # float32 unit roundoff
IDS = jnp.arange(12).reshape(2, 6) % VOCAB
# (layer path, contracted dims of its kernel): the converted layers of both models
CONVERTED = (("up", 1), ("gen", 1), ("mix", 2))
CASES = {  # (fmt, tile)
    "mxfp8": ("mxfp8_e4m3", None),
    "mxfp4": ("mxfp4", None),
    "nvfp4_16x16": ("nvfp4", (16, 16)),
    "nvfp4_1d": ("nvfp4", None),
    "fp8_block_128x128": ("fp8_e4m3_block", (128, 128)),
}


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.up = nnx.Linear(D, 96, rngs=rngs, bias_init=nnx.initializers.normal(0.1))
        self.gen = nnx.LinearGeneral(96, (2, 32), rngs=rngs)
        self.mix = nnx.LinearGeneral((2, 32), D, axis=(-2, -1), rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, ids):
        x = nn.relu(self.up(self.embed(ids)))
        return self.head(self.mix(self.gen(x)))


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, D, name="embed")(ids)
        x = nn.relu(nn.Dense(96, name="up", bias_init=nn.initializers.normal(0.1))(x))
        x = nn.DenseGeneral((2, 32), name="gen")(x)
        x = nn.DenseGeneral(D, axis=(-2, -1), name="mix")(x)
        return nn.Dense(VOCAB, name="head")(x)


def _nnx_kernels(net) -> dict:
    """``{path: (kernel, bias)}`` of the model's layers, as numpy."""
    get = lambda v: None if v is None else np.asarray(v.get_value())
    table = {"embed": (np.asarray(net.embed.embedding.get_value()), None)}
    for name in ("up", "gen", "mix", "head"):
        layer = getattr(net, name)
        table[name] = (get(layer.kernel), get(layer.bias))
    return table


def _linen_kernels(variables) -> dict:
    p = variables["params"]
    table = {"embed": (np.asarray(p["embed"]["embedding"]), None)}
    for name in ("up", "gen", "mix", "head"):
        table[name] = (p[name]["kernel"], np.asarray(p[name]["bias"]))
    return table


def _converted_nnx(fmt, tile=None, **kw):
    net = NnxNet(nnx.Rngs(0))
    original = _nnx_kernels(net)
    report = mxnnx.quantize_weights(net, fmt, tile=tile, **kw)
    stored = {name: getattr(net, name).kernel.get_value() for name, _ in CONVERTED}
    return net, original, stored, report


def _converted_linen(fmt, tile=None, **kw):
    variables = LinenNet().init(jax.random.key(0), IDS)
    model, qvars = mxl.quantize_weights(LinenNet(), variables, fmt, IDS, tile=tile, **kw)
    stored = {name: qvars["params"][name]["kernel"] for name, _ in CONVERTED}
    return model, qvars, _linen_kernels(variables), stored


def _bits(tree) -> list[np.ndarray]:
    return [np.asarray(to_bits(leaf)) for leaf in jax.tree.leaves(tree)]


def _assert_bits_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(_bits(a), _bits(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _k_by_n(kernel, n_in: int) -> np.ndarray:
    kernel = np.asarray(kernel, np.float64)
    return kernel.reshape(math.prod(kernel.shape[:n_in]), -1)


def _float64_model(original: dict, stored: dict, ids) -> tuple[np.ndarray, np.ndarray]:
    """The logits of the converted model computed in float64 (its layers with their decoded
    weights) and the bound on the float32 rounding of the model (module docstring)."""
    x = original["embed"][0].astype(np.float64)[np.asarray(ids)].reshape(-1, D)
    err = np.zeros_like(x)
    for name, n_in, relu in (
        ("up", 1, True),
        ("gen", 1, False),
        ("mix", 2, False),
        ("head", 1, False),
    ):
        kernel, bias = original[name]
        w = _k_by_n(kernel, n_in) if name not in stored else _decoded_k_by_n(stored[name])
        b = np.asarray(bias, np.float64).reshape(-1)
        err = np.abs(err) @ np.abs(w) + _dot_bound(np.abs(x) + err, w, b)
        x = x @ w + b
        x = np.maximum(x, 0.0) if relu else x
    return x.reshape(*ids.shape, VOCAB), err.reshape(*ids.shape, VOCAB)


def _decoded_k_by_n(q) -> np.ndarray:
    """The stored ``[N, K]`` weight decoded (exact in float32) as float64 ``[K, N]``."""
    return np.asarray(jaxmx.dequantize(q), np.float64).T


# --- stored weights ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_nnx_stored_weights_are_quantize_along_k(case):
    fmt, tile = CASES[case]
    net, original, stored, report = _converted_nnx(fmt, tile)
    for name, n_in in CONVERTED:
        w = jnp.asarray(_k_by_n(original[name][0], n_in), jnp.float32).T  # [N, K]
        _assert_bits_equal(stored[name], jaxmx.quantize(w, fmt, axis=-1, tile=tile))
        assert isinstance(getattr(net, name), mxnnx.QuantizedLinear)
    assert set(report.converted) == {name for name, _ in CONVERTED}


@pytest.mark.parametrize("case", ["mxfp8", "nvfp4_16x16"])
def test_linen_stored_weights_are_quantize_along_k(case):
    fmt, tile = CASES[case]
    _, qvars, original, stored = _converted_linen(fmt, tile)
    for name, n_in in CONVERTED:
        w = jnp.asarray(_k_by_n(original[name][0], n_in), jnp.float32).T
        _assert_bits_equal(stored[name], jaxmx.quantize(w, fmt, axis=-1, tile=tile))
    for name in ("embed", "head"):  # left as they were
        assert not isinstance(jax.tree.leaves(qvars["params"][name])[0], jaxmx.MXArray)


def test_mxfp8_weight_matches_numpy_reference():
    _, original, stored, _ = _converted_nnx("mxfp8_e4m3")
    w_nk = _k_by_n(original["up"][0], 1).T.astype(np.float32)
    data, scale = ref.quantize(w_nk, "mxfp8_e4m3", "rceil", axis=-1)
    q = stored["up"]
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), data.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.scale).view(np.uint8), scale)
    # the format's step: |w - w_hat| <= 2^-mbits * amax of its block
    w_hat = ref.dequantize(data, scale, -1, w_nk.shape)
    amax = np.repeat(np.abs(w_nk).reshape(96, -1, 32).max(-1), 32, axis=-1)
    assert np.all(np.abs(w_hat - w_nk) <= 2.0**-3 * amax)


# --- numerics ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mxfp8", "mxfp4", "nvfp4_16x16", "fp8_block_128x128"])
def test_nnx_weight_only_logits_within_bound(case):
    fmt, tile = CASES[case]
    net, original, stored, _ = _converted_nnx(fmt, tile)
    y_ref, bound = _float64_model(original, stored, IDS)
    y = np.asarray(nnx.jit(lambda m, ids: m(ids))(net, IDS), np.float64)
    assert np.all(np.abs(y - y_ref) <= bound)
    # the first converted layer against the original one: its weight error, plus rounding
    x = original["embed"][0][np.asarray(IDS)].reshape(-1, D).astype(np.float64)
    w, b = _k_by_n(original["up"][0], 1), np.asarray(original["up"][1], np.float64)
    w_hat = _decoded_k_by_n(stored["up"])
    up = np.asarray(net.up(jnp.asarray(x, jnp.float32)), np.float64)
    weight_error = np.abs(x) @ np.abs(w_hat - w)
    assert np.all(np.abs(up - (x @ w + b)) <= weight_error + _dot_bound(x, w_hat, b))
    assert np.max(np.abs(up - (x @ w + b))) > 1e3 * np.max(_dot_bound(x, w_hat, b))  # quantized


def test_linen_weight_only_logits_within_bound():
    model, qvars, original, stored = _converted_linen("mxfp4")
    y_ref, bound = _float64_model(original, stored, IDS)
    y = np.asarray(jax.jit(model.apply)(qvars, IDS), np.float64)
    assert np.all(np.abs(y - y_ref) <= bound)


def test_linen_partitioned_kernels_convert_as_plain_ones():
    """lm1b-style ``nn.with_logical_partitioning`` boxes: the converted layer computes
    ``x @ decoded W + b`` (numpy float64), the same as from the unboxed kernel."""

    class Net(nn.Module):
        boxed: bool

        @nn.compact
        def __call__(self, x):
            init = nn.initializers.lecun_normal()
            if self.boxed:
                init = nn.with_logical_partitioning(init, ("embed", "mlp"))
            return nn.Dense(64, kernel_init=init, name="up")(x)

    x = jax.random.normal(jax.random.key(1), (4, 32), jnp.float32)
    variables = Net(True).init(jax.random.key(0), x)
    assert isinstance(variables["params"]["up"]["kernel"], nn.LogicallyPartitioned)
    model, qvars = mxl.quantize_weights(
        Net(True), variables, "mxfp8_e4m3", x, exclude_defaults=False
    )
    plain = nn.meta.unbox(variables)
    _, qplain = mxl.quantize_weights(Net(False), plain, "mxfp8_e4m3", x, exclude_defaults=False)
    y = np.asarray(model.apply(qvars, x), np.float64)
    kernel = np.asarray(plain["params"]["up"]["kernel"], np.float32)
    data, scale = ref.quantize(kernel.T, "mxfp8_e4m3")
    w_hat = ref.dequantize(data, scale, -1, (64, 32)).T
    y_ref = np.asarray(x, np.float64) @ w_hat
    assert np.all(np.abs(y - y_ref) <= _dot_bound(np.asarray(x, np.float64), w_hat))
    np.testing.assert_array_equal(
        to_bits(qvars["params"]["up"]["kernel"].data),
        to_bits(qplain["params"]["up"]["kernel"].data),
    )


def _dot_bound(x, w, b=0.0):
    """The float32 rounding bound of ``x @ w + b`` (``K`` terms)."""
    return (x.shape[-1] + 2) * U * (np.abs(x) @ np.abs(w) + np.abs(b))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_weight_only_layer_is_x_times_decoded_weight(dtype):
    net, original, _, _ = _converted_nnx("mxfp8_e4m3")
    x = jax.random.normal(jax.random.key(1), (4, D), jnp.float32).astype(dtype)
    y = net.up(x)
    assert y.dtype == dtype  # W8A16: activations stay in their dtype
    data, scale = ref.quantize(_k_by_n(original["up"][0], 1).T.astype(np.float32), "mxfp8_e4m3")
    w_hat = ref.dequantize(data, scale, -1, (96, D)).T  # [K, N], exact in bfloat16 too
    x64, b = np.asarray(x, np.float64), np.asarray(original["up"][1], np.float64)
    y_ref = x64 @ w_hat + b
    out_rounding = np.abs(y_ref) * (2.0**-8 if dtype == jnp.bfloat16 else 0.0)
    bias_rounding = np.abs(b) * (2.0**-8 if dtype == jnp.bfloat16 else 0.0)
    bound = _dot_bound(x64, w_hat, b) + 2 * (out_rounding + bias_rounding)
    assert np.all(np.abs(np.asarray(y, np.float64) - y_ref) <= bound)


@pytest.mark.parametrize("case", ["mxfp8", "nvfp4_16x16"])
def test_w8a8_is_product_of_quantized_operands(case):
    fmt, tile = CASES[case]
    net, original, stored, report = _converted_nnx(fmt, tile, activations=True)
    assert "weights and activations" in report["up"].weights
    x = jax.random.normal(jax.random.key(2), (4, D), jnp.float32)
    y = np.asarray(net.up(x), np.float64)
    if fmt == "mxfp8_e4m3":  # the activation through the independent reference
        data, scale = ref.quantize(np.asarray(x), fmt)
        x_hat = ref.dequantize(data, scale, -1, x.shape)
    else:
        x_hat = np.asarray(jaxmx.dequantize(jaxmx.quantize(x, fmt, axis=-1)), np.float64)
    w_hat = _decoded_k_by_n(stored["up"])
    b = np.asarray(original["up"][1], np.float64)
    y_ref = x_hat @ w_hat + b
    assert np.all(np.abs(y - y_ref) <= _dot_bound(x_hat, w_hat, b))
    assert not np.allclose(x_hat, np.asarray(x))  # the activation was quantized


def test_gradient_raises():
    net, *_ = _converted_nnx("mxfp8_e4m3")
    with pytest.raises(TypeError, match="forward only"):
        nnx.grad(lambda m: m(IDS).sum())(net)
    model, qvars, *_ = _converted_linen("mxfp8_e4m3")
    with pytest.raises(TypeError, match="forward only"):
        jax.grad(lambda v: model.apply(v, IDS).sum())(qvars)


# --- checkpoints and bytes -----------------------------------------------------------------------


def _round_trip(tree, tmp_path):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", tree)
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    return checkpointer.restore(tmp_path / "ckpt", abstract)


@pytest.mark.parametrize("case", ["mxfp8", "nvfp4_16x16", "fp8_block_128x128"])
def test_nnx_orbax_round_trip_bit_for_bit(case, tmp_path):
    fmt, tile = CASES[case]
    net, *_ = _converted_nnx(fmt, tile)
    graphdef, state = nnx.split(net)
    restored = _round_trip(state, tmp_path)
    _assert_bits_equal(restored, state)
    np.testing.assert_array_equal(nnx.merge(graphdef, restored)(IDS), net(IDS))


def test_linen_orbax_round_trip_bit_for_bit(tmp_path):
    model, qvars, *_ = _converted_linen("mxfp4")
    restored = _round_trip(qvars, tmp_path)
    _assert_bits_equal(restored, qvars)
    assert isinstance(restored["params"]["up"]["kernel"], jaxmx.MXArray)
    np.testing.assert_array_equal(model.apply(restored, IDS), model.apply(qvars, IDS))


def test_plain_orbax_casts_a_weight_into_another_format_by_value(tmp_path):
    """Why save_orbax exists: the format is static metadata, not in a plain checkpoint."""
    w = jaxmx.quantize(jnp.linspace(-3.0, 3.0, 64).reshape(2, 32), "mxfp8_e4m3")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"w": w})
    checkpointer.wait_until_finished()
    e5m2 = jaxmx.quantize(jnp.zeros((2, 32)), "mxfp8_e5m2")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"w": e5m2})
    restored = checkpointer.restore(tmp_path / "ckpt", target)["w"]
    assert restored.fmt == "mxfp8_e5m2"  # the codes were cast by value: the weight changed
    assert np.abs(np.asarray(jaxmx.dequantize(restored) - jaxmx.dequantize(w))).max() > 0


def test_save_orbax_keeps_each_weights_format(tmp_path):
    net, *_ = _converted_nnx("mxfp8_e4m3")
    graphdef, state = nnx.split(net)
    jaxmx.checkpoints.save_orbax(tmp_path / "ckpt", state)
    restored = jaxmx.checkpoints.restore_orbax(tmp_path / "ckpt", state)
    _assert_bits_equal(restored, state)
    np.testing.assert_array_equal(nnx.merge(graphdef, restored)(IDS), net(IDS))
    for fmt, tile, wrong in (("mxfp8_e5m2", None, "mxfp8_e5m2"), ("nvfp4", (16, 16), "tile")):
        other, *_ = _converted_nnx(fmt, tile)
        with pytest.raises(
            ValueError, match=rf"\['kernel'\].value was saved as an mxfp8_e4m3 MXArray.*{wrong}"
        ):
            jaxmx.checkpoints.restore_orbax(tmp_path / "ckpt", nnx.split(other)[1])
    with pytest.raises(ValueError, match="the target holds no MXArray there"):
        jaxmx.checkpoints.restore_orbax(tmp_path / "ckpt", nnx.split(NnxNet(nnx.Rngs(0)))[1])


def test_an_integer_input_is_refused_as_the_input():
    net, *_ = _converted_nnx("mxfp8_e4m3")
    with pytest.raises(TypeError, match="layer's input must be a floating-point array, got int32"):
        net.up(jnp.ones((2, D), jnp.int32))


@pytest.mark.parametrize(
    "case, low, high",
    [
        ("mxfp8", 0.51, 0.53),
        ("mxfp4", 0.0, 0.29),
        ("nvfp4_16x16", 0.0, 0.29),
        ("nvfp4_1d", 0.0, 0.29),
    ],
)
def test_bytes_against_bf16(case, low, high):
    fmt, tile = CASES[case]
    _, original, _, report = _converted_nnx(fmt, tile)
    for name, _ in CONVERTED:
        bf16 = original[name][0].size * 2  # counted here from the original kernel
        assert report[name].bf16_nbytes == bf16
        assert low <= report[name].nbytes / bf16 <= high, (name, report[name].nbytes / bf16)
    converted = sum(report[name].nbytes for name, _ in CONVERTED)
    converted_bf16 = sum(original[name][0].size * 2 for name, _ in CONVERTED)
    assert low <= converted / converted_bf16 <= high
    unconverted = sum(original[name][0].size * 4 for name in ("embed", "head"))  # float32
    assert report.nbytes == converted + unconverted
    assert report.bf16_nbytes == sum(original[n][0].size * 2 for n in original)
    table = str(report)
    assert f"{report['up'].nbytes:,} B" in table and f"{report.nbytes:,} B" in table


def test_linen_report_lists_every_layer_in_call_order():
    model, *_ = _converted_linen("mxfp8_e4m3")
    report = mxl.weights_report(model)
    assert list(report) == ["embed", "up", "gen", "mix", "head"]
    assert report["embed"].reason.startswith("embedding table")
    assert report["head"].reason.startswith("excluded by default")
    assert report.nbytes == sum(p.nbytes for p in report.values())


# --- which layers --------------------------------------------------------------------------------


def test_include_and_exclude_are_honoured():
    _, _, _, report = _converted_nnx("mxfp8_e4m3", include="up")
    assert list(report.converted) == ["up"]
    _, _, _, report = _converted_nnx("mxfp8_e4m3", exclude="gen")
    assert set(report.converted) == {"up", "mix"}
    assert report["gen"].reason == "excluded: exclude pattern 'gen'"
    _, _, _, report = _converted_nnx("mxfp8_e4m3", include="head")  # a literal name wins
    assert list(report.converted) == ["head"]
    model, *_ = _converted_linen("mxfp8_e4m3", exclude=("mix",))
    assert set(mxl.weights_report(model).converted) == {"up", "gen"}


def test_unmatched_patterns_raise_or_warn():
    with pytest.raises(ValueError, match=r"quantize_weights: include pattern\(s\) \['nope'\]"):
        _converted_nnx("mxfp8_e4m3", include="nope")
    with pytest.raises(ValueError, match=r"include pattern\(s\) \['nope'\]"):
        _converted_linen("mxfp8_e4m3", include="nope")
    with pytest.warns(UserWarning, match=r"exclude pattern\(s\) \['nope'\]"):
        _converted_nnx("mxfp8_e4m3", exclude="nope")


class NothingToConvert(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.mix = nnx.Einsum("btd,dh->bth", (D, 32), rngs=rngs)
        self.head = nnx.Linear(32, VOCAB, rngs=rngs)


def test_nothing_to_convert_raises_and_einsum_is_reported():
    net = NothingToConvert(nnx.Rngs(0))
    with pytest.raises(ValueError, match="no layer of the model to convert") as info:
        mxnnx.quantize_weights(net, "mxfp8_e4m3")
    assert "Einsum's contracting axes are set by its equation" in str(info.value)
    assert isinstance(net.head, nnx.Linear) and not isinstance(net.head, mxnnx.QuantizedLinear)
    with pytest.raises(ValueError, match="no layer of the model to convert"):
        _converted_nnx("mxfp8_e4m3", exclude=("up", "gen", "mix"))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown MX format"):
        mxnnx.quantize_weights(NnxNet(nnx.Rngs(0)), "int8")
    with pytest.raises(ValueError, match="tile must be None or"):
        mxnnx.quantize_weights(NnxNet(nnx.Rngs(0)), "nvfp4", tile=16)
    with pytest.raises(ValueError, match="itself a Linear layer"):
        mxnnx.quantize_weights(nnx.Linear(D, 8, rngs=nnx.Rngs(0)), "mxfp8_e4m3")
    variables = LinenNet().init(jax.random.key(0), IDS)
    with pytest.raises(ValueError, match="without 'params'"):
        mxl.quantize_weights(LinenNet(), variables["params"], "mxfp8_e4m3", IDS)
    model, qvars = mxl.quantize_weights(LinenNet(), variables, "mxfp8_e4m3", IDS)
    with pytest.raises(TypeError, match="already converted"):
        mxl.quantize_weights(model, qvars, "mxfp8_e4m3", IDS)
    with pytest.raises(TypeError, match="apply the module to the variables"):
        model.apply(variables, IDS)  # the original float kernels
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model.apply(qvars, IDS).shape == (*IDS.shape, VOCAB)


class Vmapped(nn.Module):
    @nn.compact
    def __call__(self, x):
        experts = nn.vmap(
            nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=0
        )
        return experts(D, name="experts")(x)


def test_stacked_kernel_of_a_lifted_layer_raises():
    x = jnp.ones((2, 3, D))
    variables = Vmapped().init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"layer 'experts' has a kernel of shape \(2, 64, 64\)"):
        mxl.quantize_weights(Vmapped(), variables, "mxfp8_e4m3", x)


class Shared(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D, D, rngs=rngs)
        self.again = self.up  # the same layer under a second path
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, x):
        return self.head(self.again(self.up(x)))


def test_a_layer_shared_by_two_paths_is_converted_at_both():
    net = Shared(nnx.Rngs(0))
    kernel = np.asarray(net.up.kernel.get_value())
    mxnnx.quantize_weights(net, "mxfp8_e4m3")
    assert isinstance(net.up, mxnnx.QuantizedLinear) and net.again is net.up
    expected = jaxmx.quantize(jnp.asarray(kernel).T, "mxfp8_e4m3", axis=-1)
    np.testing.assert_array_equal(
        to_bits(net.again.kernel.get_value().data), to_bits(expected.data)
    )


class Hooked(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D, D, rngs=rngs)
        self.mx = nnx.Linear(D, D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)


def test_a_layer_with_its_own_gemm_hook_is_reported_not_converted():
    net = Hooked(nnx.Rngs(0))
    mxnnx.quantize_model(net, include="mx")  # the layer's dot_general is now jaxmx's
    report = mxnnx.quantize_weights(net, "mxfp8_e4m3")
    assert list(report.converted) == ["up"]
    assert "sets its own dot_general" in report["mx"].reason

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(D, name="up")(x)
            return nn.Dense(D, name="mx", dot_general=jaxmx.flax.MXDotGeneral())(x)

    x = jnp.ones((2, D))
    model, _ = mxl.quantize_weights(
        Dense(), Dense().init(jax.random.key(0), x), "mxfp8_e4m3", x, exclude_defaults=False
    )
    report = mxl.weights_report(model)
    assert list(report.converted) == ["up"]
    assert "sets its own dot_general" in report["mx"].reason
