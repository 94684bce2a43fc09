"""Hugging Face checkpoints into and out of Flax models: ``jaxmx.flax.nnx.load_checkpoint`` /
``export_checkpoint``, their linen twins, and the name map ``hf_name``.

A small model with Hugging Face's attribute names (an embedding, a norm, and an MLP's two Linear
layers whose ``[224, 160]`` weights do not divide into 128x128 tiles) is written as a checkpoint
with ``jaxmx.checkpoints.save`` in two schemes (compressed-tensors' block FP8, ModelOpt's NVFP4;
an export writes compressed-tensors' MXFP4 and NVFP4). Loaded weights are checked against a decode
written here from the raw bytes of the safetensors file (numpy + ml_dtypes, never
``jaxmx.dequantize``); exports are compared with the original file tensor by tensor, byte for
byte.
"""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors_bytes import raw_tensors

import jaxmx
import jaxmx.flax.linen as mxl
import jaxmx.flax.nnx as mxnnx
from jaxmx import checkpoints
from jaxmx._src.checkpoints.fresh import quantized_weight
from jaxmx.checkpoints import Checkpoint, CheckpointError, Scheme

V, H, F = 48, 160, 224  # vocab, hidden, FFN: 160 and 224 are not multiples of 128
G, U = "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"
GATE = "model/layers/0/mlp/gate_proj/kernel"
IDS = jnp.arange(12).reshape(2, 6) % V
SCHEMES = {  # (scheme, fmt, tile); block FP8 as compressed-tensors stores it (float32 scales)
    "fp8_block": (
        Scheme(method="compressed-tensors", weights="block", scale_dtype="float32"),
        "fp8_e4m3_block",
        (128, 128),
    ),
    "nvfp4": (Scheme(method="modelopt", weights="nvfp4"), "nvfp4", None),
}  # MXFP4 (compressed-tensors) is written afresh by test_an_export_without_like_quantizes_afresh


# --- the models ----------------------------------------------------------------------------------


ZEROS = nnx.initializers.zeros


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.gate_proj = nnx.Linear(H, F, kernel_init=ZEROS, rngs=rngs)
        self.up_proj = nnx.Linear(H, F, use_bias=False, kernel_init=ZEROS, rngs=rngs)


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.mlp = MLP(rngs)


class Decoder(nnx.Module):
    def __init__(self, rngs):
        self.embed_tokens = nnx.Embed(V, H, embedding_init=ZEROS, rngs=rngs)
        self.layers = nnx.List([Layer(rngs)])
        self.norm = nnx.RMSNorm(H, rngs=rngs)


class Net(nnx.Module):
    """Made with zeros (a checkpoint sets every parameter), so no random initializer compiles."""

    def __init__(self, rngs):
        self.model = Decoder(rngs)

    def __call__(self, ids):
        h = self.model.norm(self.model.embed_tokens(ids))
        mlp = self.model.layers[0].mlp
        return jax.nn.silu(mlp.gate_proj(h)) * mlp.up_proj(h)


def _net(abstract: bool = True) -> Net:
    return nnx.eval_shape(lambda: Net(nnx.Rngs(0))) if abstract else Net(nnx.Rngs(0))


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, h):
        gate = nn.Dense(F, kernel_init=ZEROS, name="gate_proj")
        up = nn.Dense(F, use_bias=False, kernel_init=ZEROS, name="up_proj")
        return jax.nn.silu(gate(h)) * up(h)


class LinenLayer(nn.Module):
    @nn.compact
    def __call__(self, h):
        return LinenMLP(name="mlp")(h)


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, ids):
        h = nn.RMSNorm(name="norm")(nn.Embed(V, H, embedding_init=ZEROS, name="embed_tokens")(ids))
        return LinenLayer(name="layers_0")(h)


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, ids):
        return LinenModel(name="model")(ids)


def _linen_params(abstract: bool = True):
    init = lambda: LinenNet().init(jax.random.key(0), IDS)["params"]
    return jax.eval_shape(init) if abstract else init()


# --- the checkpoints, written by hand ------------------------------------------------------------


def _tensors(case: str) -> dict:
    _, fmt, tile = SCHEMES[case]
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)
    embed = normal(V, H)
    embed[:, 128:] = 0  # features 128.. stay zero
    bf16 = ml_dtypes.bfloat16
    return {
        "model.embed_tokens.weight": embed.astype(bf16),
        f"{G}.weight": jaxmx.quantize(normal(F, H) * 0.05, fmt, 1, tile=tile),
        f"{G}.bias": (normal(F) * 0.1).astype(bf16),
        f"{G}.input_scale": np.float32(0.02),
        f"{U}.weight": jaxmx.quantize(normal(F, H) * 0.05, fmt, 1, tile=tile),
        "model.norm.weight": (1 + 0.1 * normal(H)).astype(bf16),
    }


@pytest.fixture(scope="module", params=list(SCHEMES))
def case(request, tmp_path_factory):
    """``(case name, checkpoint directory)``."""
    path = tmp_path_factory.mktemp(request.param)
    checkpoints.save(
        path, _tensors(request.param), SCHEMES[request.param][0], config={"model_type": "llama"}
    )
    return request.param, path


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8")
    checkpoints.save(path, _tensors("fp8_block"), SCHEMES["fp8_block"][0])
    return path


def _with(ckpt: Checkpoint, drop: str = "", **add) -> Checkpoint:
    tensors = {k: v for k, v in ckpt.tensors.items() if k != drop}
    return Checkpoint(tensors={**tensors, **add}, scheme=ckpt.scheme, config=ckpt.config)


# --- the reference decode, from the file's bytes -------------------------------------------------

DTYPES = {
    "F32": np.dtype(np.float32),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "U8": np.dtype(np.uint8),
}
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def array(entry) -> np.ndarray:
    dtype, shape, b = entry
    return np.frombuffer(b, DTYPES[dtype]).reshape(shape)


def decoded(tensors: dict, module: str, case: str) -> np.ndarray:
    """The float32 ``[out, in]`` weight of ``module`` decoded from the file's bytes."""
    if case == "fp8_block":
        codes = array(tensors[f"{module}.weight"]).astype(np.float64)
        s = array(tensors[f"{module}.weight_scale"]).astype(np.float64)
        n, k = codes.shape
        grid = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:n, :k]
        return (codes * grid).astype(np.float32)  # one rounding, as float32's product
    packed = array(tensors[f"{module}.weight_packed" if case == "mxfp4" else f"{module}.weight"])
    codes = E2M1[np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)]
    s = array(tensors[f"{module}.weight_scale"]).astype(np.float64)
    if case == "mxfp4":  # E8M0 bytes: 2^(b - 127)
        return (codes * np.repeat(2.0 ** (s - 127), 32, axis=1)).astype(np.float32)
    g = array(tensors[f"{module}.weight_scale_2"]).astype(np.float32)
    return (codes * np.repeat(s, 16, axis=1)).astype(np.float32) * g  # (code * s) * g


def plain(tensors: dict, name: str) -> np.ndarray:
    return array(tensors[name]).astype(np.float32)


def same_mxarray(a: jaxmx.MXArray, b: jaxmx.MXArray) -> bool:
    """The same format, layout and leaves, bit for bit."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return (
        (a.fmt, a.axis, a.shape, a.tile) == (b.fmt, b.axis, b.shape, b.tile)
        and len(la) == len(lb)
        and all(
            np.asarray(x).dtype == np.asarray(y).dtype
            and np.asarray(x).tobytes() == np.asarray(y).tobytes()
            for x, y in zip(la, lb, strict=True)
        )
    )


# --- names ---------------------------------------------------------------------------------------


def test_hf_name():
    assert mxnnx.hf_name(("model", "layers", 0, "self_attn", "q_proj", "kernel")) == (
        "model.layers.0.self_attn.q_proj.weight",
        True,
    )
    assert mxl.hf_name(("model", "layers_3", "mlp", "down_proj", "bias")) == (
        "model.layers.3.mlp.down_proj.bias",
        False,
    )
    assert mxnnx.hf_name(("model", "embed_tokens", "embedding")) == (
        "model.embed_tokens.weight",
        False,
    )
    assert mxnnx.hf_name(("model", "norm", "scale")) == ("model.norm.weight", False)


def test_a_names_dict_replaces_entries_and_refuses_unknown_paths(fp8_dir):
    ckpt = checkpoints.load(fp8_dir)
    renamed = _with(ckpt, "model.norm.weight", norm_weight=ckpt.tensors["model.norm.weight"])
    report = mxnnx.load_checkpoint(_net(), renamed, names={"model/norm/scale": "norm_weight"})
    assert report.loaded["model/norm/scale"].tensor == "norm_weight"
    with pytest.raises(CheckpointError, match="model/norm/weight"):
        mxnnx.load_checkpoint(_net(), ckpt, names={"model/norm/weight": "x"})


# --- nnx: loading --------------------------------------------------------------------------------


def test_master_weights_equal_the_reference_decode(case):
    name, path = case
    tensors = raw_tensors(path)
    net = _net()
    report = mxnnx.load_checkpoint(net, checkpoints.load(path))
    mlp = net.model.layers[0].mlp
    want = [
        (mlp.gate_proj.kernel, decoded(tensors, G, name).T),
        (mlp.up_proj.kernel, decoded(tensors, U, name).T),
        (mlp.gate_proj.bias, plain(tensors, f"{G}.bias")),
        (net.model.embed_tokens.embedding, plain(tensors, "model.embed_tokens.weight")),
        (net.model.norm.scale, plain(tensors, "model.norm.weight")),
    ]
    for param, value in want:
        assert param.get_value().dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(param.get_value()), value)
    assert report.loaded[GATE].how == "dequantized"
    assert report.loaded["model/norm/scale"].how == "copied"
    assert report.unused == (f"{G}.input_scale",) and not report.unexpected


def test_weights_at_rest_keep_the_bytes_and_compute_the_reference(case):
    _, path = case
    ckpt = checkpoints.load(path)
    master, rest = _net(), _net()
    mxnnx.load_checkpoint(master, ckpt)
    report = mxnnx.load_checkpoint(rest, ckpt, at_rest=True)
    mlp = rest.model.layers[0].mlp
    assert isinstance(mlp.gate_proj, mxnnx.QuantizedLinear)
    assert same_mxarray(mlp.gate_proj.kernel.get_value(), ckpt.tensors[f"{G}.weight"])
    assert same_mxarray(mlp.up_proj.kernel.get_value(), ckpt.tensors[f"{U}.weight"])
    assert report.loaded[GATE].how == "at rest"
    assert report.loaded["model/layers/0/mlp/gate_proj/bias"].how == "copied"
    # the master weights are the reference decode (test above): the same forward
    np.testing.assert_allclose(rest(IDS), master(IDS), rtol=1e-6, atol=1e-6)


def test_load_into_an_abstract_or_a_concrete_model(fp8_dir):
    net, concrete = _net(), _net(abstract=False)
    assert isinstance(net.model.norm.scale.get_value(), jax.ShapeDtypeStruct)
    mxnnx.load_checkpoint(net, checkpoints.load(fp8_dir))
    mxnnx.load_checkpoint(concrete, checkpoints.load(fp8_dir))
    assert isinstance(net.model.norm.scale.get_value(), jax.Array)
    np.testing.assert_array_equal(net(IDS), concrete(IDS))
    params, _ = mxl.load_checkpoint(_linen_params(), checkpoints.load(fp8_dir))
    assert isinstance(params["model"]["norm"]["scale"], jax.Array)
    concrete, _ = mxl.load_checkpoint(_linen_params(abstract=False), checkpoints.load(fp8_dir))
    np.testing.assert_array_equal(
        concrete["model"]["norm"]["scale"], params["model"]["norm"]["scale"]
    )


# --- nnx: exporting ------------------------------------------------------------------------------


@pytest.mark.parametrize("at_rest", [False, True], ids=["master", "at_rest"])
def test_an_unchanged_export_gives_back_every_byte(case, at_rest, tmp_path):
    _, path = case
    ckpt = checkpoints.load(path)
    net = _net()
    mxnnx.load_checkpoint(net, ckpt, at_rest=at_rest)
    mxnnx.export_checkpoint(net, tmp_path, like=ckpt)
    assert raw_tensors(tmp_path) == raw_tensors(path)
    assert json.loads((tmp_path / "config.json").read_text()) == ckpt.config


def test_an_export_after_a_training_step_keeps_the_scales_of_untouched_blocks(fp8_dir, tmp_path):
    ckpt = checkpoints.load(fp8_dir)
    net = _net()
    mxnnx.load_checkpoint(net, ckpt)
    kernel = net.model.layers[0].mlp.gate_proj.kernel
    # an SGD step on 0.5 |x k - t|^2 (gradient x^T (x k - t)) for inputs x whose features 128..
    # are zero, then one weight of tile (0, 0) grown past its scale
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, H)).astype(np.float32)
    x[:, 128:] = 0
    t = rng.standard_normal((8, F)).astype(np.float32)
    k = np.array(kernel.get_value())
    k -= 1e-3 * x.T @ (x @ k - t)
    k[0, 0] += 100.0
    kernel.set_value(jnp.asarray(k))
    mxnnx.export_checkpoint(net, tmp_path, like=ckpt)

    before, after = raw_tensors(fp8_dir), raw_tensors(tmp_path)
    assert after.keys() == before.keys()
    s0, s1 = (array(t[f"{G}.weight_scale"]) for t in (before, after))
    c0, c1 = (array(t[f"{G}.weight"]).view(np.uint8) for t in (before, after))
    # no gradient reached the inputs 128..: those tiles keep their codes and scales
    np.testing.assert_array_equal(s1[:, 1], s0[:, 1])
    np.testing.assert_array_equal(c1[:, 128:], c0[:, 128:])
    assert not np.array_equal(c1[128:, :128], c0[128:, :128])
    assert s1[1, 0] == s0[1, 0]  # tile (1, 0) changed within its scale: kept
    assert s1[0, 0] > 99 / 448 > s0[0, 0]  # outgrew its scale: a fresh one
    # the written weight is the trained one, to within half a code step (subnormals included)
    w = np.asarray(kernel.get_value()).T
    tile_scale = np.repeat(np.repeat(s1, 128, axis=0), 128, axis=1)[:F, :H]
    err = np.abs(decoded(after, G, "fp8_block") - w)
    assert (err <= 2.0**-4 * np.abs(w) + 2.0**-10 * tile_scale).all()
    assert after["model.norm.weight"][0] == "BF16" and after[f"{U}.weight"] == before[f"{U}.weight"]


@pytest.mark.parametrize(
    "scheme",
    [
        Scheme(method="compressed-tensors", weights="block"),  # bfloat16 scales
        Scheme(method="compressed-tensors", weights="mxfp4"),
        Scheme(method="compressed-tensors", weights="nvfp4"),
    ],
    ids=["ct_block_bf16_scales", "ct_mxfp4", "ct_nvfp4"],
)
def test_an_export_without_like_quantizes_afresh(fp8_dir, tmp_path, scheme):
    net = _net()
    mxnnx.load_checkpoint(net, checkpoints.load(fp8_dir))
    mxnnx.export_checkpoint(net, tmp_path, scheme=scheme, exclude=("up_proj",), dtype=jnp.bfloat16)
    out = checkpoints.load(tmp_path)
    assert out.scheme == scheme
    q = out.tensors[f"{G}.weight"]
    assert q.fmt == {"block": "fp8_e4m3_block", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}[scheme.weights]
    # within half the top code step of each row's largest magnitude (scales rounded up or to
    # a power of two: at most twice that magnitude's)
    w = np.asarray(net.model.layers[0].mlp.gate_proj.kernel.get_value()).T
    err = np.abs(np.asarray(jaxmx.dequantize(q)) - w)
    step = 32 / 448 if q.fmt == "fp8_e4m3_block" else 2 / 6
    assert (err <= step * np.abs(w).max(axis=1, keepdims=True)).all()
    assert not isinstance(out.tensors[f"{U}.weight"], jaxmx.MXArray)  # excluded
    assert out.tensors["model.norm.weight"].dtype == jnp.bfloat16
    assert f"{G}.input_scale" not in out.tensors


def test_a_fresh_compressed_tensors_nvfp4_tensor_scale_has_an_exact_reciprocal():
    """compressed-tensors stores 1 / g: a g whose reciprocal does not convert back to it is
    replaced by the power of two above it."""
    w = np.random.default_rng(4).standard_normal((F, H), np.float32)
    amax = np.abs(w).max()
    for c in np.float32(1) + np.arange(64, dtype=np.float32) / 64:
        g = np.float32(amax * c) / np.float32(448 * 6)
        if np.float32(1) / (np.float32(1) / g) != g:
            break
    else:
        pytest.fail("no scale without an exact reciprocal among the candidates")
    q = quantized_weight(w * c, Scheme(method="compressed-tensors", weights="nvfp4"), "w")
    got = np.float32(q.global_scale)
    assert got == 2.0 ** np.ceil(np.log2(g)) and np.float32(1) / (np.float32(1) / got) == got


def test_an_encode_factor_kept_beside_its_weight_is_part_of_it(tmp_path):
    """compressed-tensors' NVFP4 encode factor 102.59 has no float32 reciprocal that converts
    back: ``checkpoints.load`` keeps it beside the MXArray; it is the weight's, not unused."""
    e = np.float32(102.59)
    w = np.random.default_rng(2).standard_normal((F, H), np.float32)
    q = jaxmx.quantize(w, "nvfp4", global_scale=np.float32(1) / e)
    tensors = {k: v for k, v in _tensors("fp8_block").items() if not k.startswith(G)}
    tensors.update(
        {
            f"{G}.weight": q,
            f"{G}.weight_global_scale": np.array([e]),
            f"{G}.bias": np.zeros(F, np.float32),
        }
    )
    tensors[f"{U}.weight"] = jaxmx.quantize(w, "nvfp4")
    checkpoints.save(tmp_path / "in", tensors, Scheme(method="compressed-tensors", weights="nvfp4"))
    with pytest.warns(UserWarning, match="reciprocal"):
        ckpt = checkpoints.load(tmp_path / "in", inexact_tensor_scales="warn")
    net = _net()
    report = mxnnx.load_checkpoint(net, ckpt)  # no warning: nothing unused
    assert report.unused == ()
    mxnnx.export_checkpoint(net, tmp_path / "out", like=ckpt)
    assert raw_tensors(tmp_path / "out") == raw_tensors(tmp_path / "in")


# --- errors --------------------------------------------------------------------------------------


def test_a_missing_tensor_names_the_parameter_and_the_tensor(fp8_dir):
    ckpt = _with(checkpoints.load(fp8_dir), "model.norm.weight")
    net = _net()
    with pytest.raises(CheckpointError, match=r"'model/norm/scale'.*'model\.norm\.weight'"):
        mxnnx.load_checkpoint(net, ckpt)
    # every name and shape is checked before a parameter is set
    assert isinstance(net.model.embed_tokens.embedding.get_value(), jax.ShapeDtypeStruct)
    with pytest.raises(CheckpointError, match=r"'model/norm/scale'.*'model\.norm\.weight'"):
        mxl.load_checkpoint(_linen_params(), ckpt)


def test_a_tensor_of_the_wrong_shape_names_both_and_the_shapes(fp8_dir):
    bad = _with(checkpoints.load(fp8_dir), **{f"{G}.weight": jnp.ones((F, H + 1))})
    with pytest.raises(CheckpointError) as e:
        mxnnx.load_checkpoint(_net(), bad)
    for part in (GATE, f"{G}.weight", "[160, 224]", "[224, 161]"):
        assert part in str(e.value)
    with pytest.raises(CheckpointError, match=r"layers_0/mlp/gate_proj/kernel.*\[224, 161\]"):
        mxl.load_checkpoint(_linen_params(), bad)


def test_unused_tensors_are_listed_and_warned_unless_activation_scales(fp8_dir):
    extra = _with(checkpoints.load(fp8_dir), **{"model.extra.weight": jnp.ones(3)})
    with pytest.warns(UserWarning, match="model.extra.weight") as record:
        report = mxnnx.load_checkpoint(_net(), extra)
    assert all("input_scale" not in str(w.message) for w in record)
    assert report.unused == (f"{G}.input_scale", "model.extra.weight")
    assert report.activation_scales == (f"{G}.input_scale",)
    text = str(report)
    assert f"{GATE}  {G}.weight  dequantized  fp8_e4m3_block 128x128 tiles" in text
    assert "unused: model.extra.weight" in text and f"at run time): {G}.input_scale" in text


# --- linen ---------------------------------------------------------------------------------------


def test_linen_master_weights_and_an_unchanged_export(case, tmp_path):
    name, path = case
    tensors, ckpt = raw_tensors(path), checkpoints.load(path)
    params, report = mxl.load_checkpoint(_linen_params(), ckpt)
    mlp = params["model"]["layers_0"]["mlp"]
    np.testing.assert_array_equal(mlp["gate_proj"]["kernel"], decoded(tensors, G, name).T)
    np.testing.assert_array_equal(mlp["up_proj"]["kernel"], decoded(tensors, U, name).T)
    np.testing.assert_array_equal(mlp["gate_proj"]["bias"], plain(tensors, f"{G}.bias"))
    np.testing.assert_array_equal(
        params["model"]["norm"]["scale"], plain(tensors, "model.norm.weight")
    )
    assert report.loaded["model/layers_0/mlp/gate_proj/kernel"].tensor == f"{G}.weight"
    assert report.unused == (f"{G}.input_scale",)
    mxl.export_checkpoint(params, tmp_path, like=ckpt)
    assert raw_tensors(tmp_path) == raw_tensors(path)


def test_linen_weights_at_rest_through_quantize_weights(fp8_dir, tmp_path):
    ckpt = checkpoints.load(fp8_dir)
    master, _ = mxl.load_checkpoint(_linen_params(), ckpt)
    module, qvars = mxl.quantize_weights(
        LinenNet(), {"params": master}, "fp8_e4m3_block", IDS, tile=(128, 128)
    )
    params, report = mxl.load_checkpoint(qvars["params"], ckpt)
    gate = params["model"]["layers_0"]["mlp"]["gate_proj"]["kernel"]
    assert same_mxarray(gate, ckpt.tensors[f"{G}.weight"])
    assert report.loaded["model/layers_0/mlp/gate_proj/kernel"].how == "at rest"
    want = LinenNet().apply({"params": master}, IDS)
    np.testing.assert_allclose(module.apply({"params": params}, IDS), want, rtol=1e-6, atol=1e-6)
    mxl.export_checkpoint(params, tmp_path, like=ckpt)
    assert raw_tensors(tmp_path) == raw_tensors(fp8_dir)
    other = jaxmx.quantize(jnp.ones((F, H)), "mxfp4")
    with pytest.raises(CheckpointError, match=r"fp8_e4m3_block 128x128 tiles.*mxfp4"):
        mxl.load_checkpoint(params, _with(ckpt, **{f"{G}.weight": other}))
