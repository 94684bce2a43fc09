"""jaxmx.checkpoints against checkpoints laid out by hand in each peer's convention (numpy and
ml_dtypes here, following /shared's fact sheet; tests/interop checks the peers' own code): the
values decoded by a numpy reference, the bytes written back, the errors, sharded loads, and
requantization against kept scales."""

from __future__ import annotations

import json
import pathlib
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
from safetensors_bytes import raw_tensors

import jaxmx
from jaxmx import checkpoints
from jaxmx.checkpoints import CheckpointError, Scheme

E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
FP4_VALUES = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32
)
RNG = np.random.default_rng(0)


# -- peers' layouts, by hand ------------------------------------------------------------------


def write_dir(path, tensors, qc=None, hf_quant=None, shards=1):
    """A checkpoint directory: ``tensors`` in ``shards`` safetensors files (with an index when
    more than one), ``config.json`` with ``qc`` as its quantization_config."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for i, part in enumerate(np.array_split(np.arange(len(names)), shards)):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({names[j]: tensors[names[j]] for j in part}, str(path / file))
            weight_map.update({names[j]: file for j in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {"model_type": "llama"}
    if qc is not None:
        config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return path


def e4m3_codes(shape):
    """Random E4M3 codes, every finite magnitude possible."""
    b = RNG.integers(0, 256, shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] = 0x10  # no NaN
    return b.view(E4M3)


def packed_fp4(shape):
    """Random bytes holding two E2M1 codes each, and the codes' values (even element low)."""
    packed = RNG.integers(0, 256, shape, dtype=np.uint8)
    values = np.stack([FP4_VALUES[packed & 0xF], FP4_VALUES[packed >> 4]], -1)
    return packed, values.reshape(*shape[:-1], 2 * shape[-1])


def tile_expand(scale, shape, tile):
    """Block scales repeated over their tiles and cropped to ``shape``."""
    grown = np.repeat(np.repeat(scale, tile[0], axis=-2), tile[1], axis=-1)
    return grown[..., : shape[-2], : shape[-1]]


def pow2_of(b):
    return (2.0 ** (b.astype(np.float64) - 127)).astype(np.float32)


def decoded(q) -> np.ndarray:
    return np.asarray(jaxmx.dequantize(q, jnp.float32))


# -- formats -----------------------------------------------------------------------------------

FP8_BLOCK = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}


@pytest.mark.parametrize("shape", [(200, 256), (129, 300), (2, 136, 100)])
def test_fp8_block_float_scales(tmp_path, shape):
    """transformers' block FP8 (DeepSeek-V3 / Qwen3): a ceil grid of decode factors, values
    ``q * s[i // 128, j // 128]``, cropped; written back byte for byte."""
    codes = e4m3_codes(shape)
    grid = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    scale = RNG.uniform(1e-4, 1e-2, grid).astype(np.float32)
    bias = RNG.standard_normal(shape[-2]).astype(ml_dtypes.bfloat16)
    src = write_dir(
        tmp_path / "src",
        {"m.weight": codes, "m.weight_scale_inv": scale, "m.bias": bias},
        FP8_BLOCK,
    )
    ckpt = checkpoints.load(src)
    q = ckpt.tensors["m.weight"]
    assert (q.fmt, q.tile, q.shape) == ("fp8_e4m3_block", (128, 128), shape)
    want = codes.astype(np.float32) * tile_expand(scale, shape, (128, 128))
    np.testing.assert_array_equal(decoded(q), want)
    assert ckpt.tensors["m.bias"].dtype == jnp.bfloat16
    misread = any(n % 128 and n > 128 for n in shape[-2:])  # by transformers' loader
    with pytest.warns(UserWarning, match="would misread") if misread else nullcontext():
        checkpoints.save(tmp_path / "out", ckpt.tensors, ckpt.scheme, config=ckpt.config)
    assert raw_tensors(tmp_path / "out") == raw_tensors(src)
    assert (
        json.loads((tmp_path / "out/config.json").read_text())["quantization_config"] == FP8_BLOCK
    )


def test_fp8_block_ue8m0_scales(tmp_path):
    """DeepSeek's newer UE8M0 tile scales (float8_e8m0fnu or raw uint8 bytes): 2^(b - 127)."""
    shape = (256, 384)
    codes = e4m3_codes(shape)
    b = RNG.integers(0, 255, (2, 3), dtype=np.uint8)
    b[0, 0] = 0  # 2^-127: a float32 subnormal, exact
    qc = {**FP8_BLOCK, "scale_fmt": "ue8m0"}
    for stored in (b.view(E8M0), b):
        src = write_dir(
            tmp_path / str(stored.dtype), {"m.weight": codes, "m.weight_scale_inv": stored}, qc
        )
        ckpt = checkpoints.load(src)
        assert ckpt.scheme.scale_dtype == "ue8m0"
        want = codes.astype(np.float32) * tile_expand(pow2_of(b), shape, (128, 128))
        np.testing.assert_array_equal(decoded(ckpt.tensors["m.weight"]), want)
    out = tmp_path / "out"
    checkpoints.save(out, ckpt.tensors, ckpt.scheme)
    assert raw_tensors(out)["m.weight_scale_inv"] == ("F8_E8M0", [2, 3], b.tobytes())


def test_fp8_per_tensor_and_per_channel(tmp_path):
    """Per-tensor FP8 (transformers: a 0-d decode factor) and compressed-tensors' per-tensor
    ([1]) and per-channel ([out, 1]) bf16 decode factors."""
    shape = (48, 40)
    codes = e4m3_codes(shape)
    s = np.float32(0.0123)
    src = write_dir(
        tmp_path / "hf",
        {"m.weight": codes, "m.weight_scale_inv": np.array(s)},
        {**FP8_BLOCK, "weight_block_size": None},
    )
    ckpt = checkpoints.load(src)
    np.testing.assert_array_equal(decoded(ckpt.tensors["m.weight"]), codes.astype(np.float32) * s)
    checkpoints.save(tmp_path / "hf_out", ckpt.tensors, ckpt.scheme)
    assert raw_tensors(tmp_path / "hf_out") == raw_tensors(src)
    for strategy, scale_shape in (("tensor", (1,)), ("channel", (48, 1))):
        scale = RNG.uniform(1e-3, 1, scale_shape).astype(ml_dtypes.bfloat16)
        qc = ct_config("float-quantized", num_bits=8, strategy=strategy)
        src = write_dir(tmp_path / strategy, {"m.weight": codes, "m.weight_scale": scale}, qc)
        ckpt = checkpoints.load(src)
        assert (ckpt.scheme.weights, ckpt.scheme.scale_dtype) == (strategy, "bfloat16")
        want = codes.astype(np.float32) * scale.astype(np.float32).reshape(-1, 1)
        np.testing.assert_array_equal(decoded(ckpt.tensors["m.weight"]), want)
        checkpoints.save(tmp_path / f"{strategy}_out", ckpt.tensors, ckpt.scheme)
        assert raw_tensors(tmp_path / f"{strategy}_out") == raw_tensors(src)


def ct_config(fmt, *, num_bits, strategy, group_size=None, block=None, ignore=()):
    weights = {
        "num_bits": num_bits,
        "type": "float",
        "symmetric": True,
        "strategy": strategy,
        "group_size": group_size,
        "block_structure": block,
        "dynamic": False,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": list(ignore),
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }


def test_compressed_tensors_fp4_and_mxfp8(tmp_path):
    """compressed-tensors' MXFP4 (packed, low nibble first, uint8 E8M0), NVFP4 (E4M3 scales
    per 16 and an encode-factor global scale) and MXFP8, decoded by the numpy reference."""
    packed, values = packed_fp4((24, 32))
    e8 = RNG.integers(100, 140, (24, 2), dtype=np.uint8)
    s4 = RNG.uniform(0.01, 400, (24, 4)).astype(E4M3)
    g_enc = np.array([2.0**7], np.float32)  # a power of two: its reciprocal is exact
    mx8 = e4m3_codes((24, 70))
    e8_70 = RNG.integers(100, 140, (24, 3), dtype=np.uint8)
    cases = {
        "mxfp4": (
            "mxfp4-pack-quantized",
            dict(num_bits=4, strategy="group", group_size=32),
            {"m.weight_packed": packed, "m.weight_scale": e8},
            values * np.repeat(pow2_of(e8), 32, -1),
        ),
        "nvfp4": (
            "nvfp4-pack-quantized",
            dict(num_bits=4, strategy="tensor_group", group_size=16),
            {"m.weight_packed": packed, "m.weight_scale": s4, "m.weight_global_scale": g_enc},
            values * np.repeat(s4.astype(np.float32), 16, -1) * (np.float32(1) / g_enc[0]),
        ),
        "mxfp8": (
            "mxfp8-quantized",
            dict(num_bits=8, strategy="group", group_size=32),
            {"m.weight": mx8, "m.weight_scale": e8_70},
            mx8.astype(np.float32) * np.repeat(pow2_of(e8_70), 32, -1)[:, :70],
        ),
    }
    for layout, (fmt, args, tensors, want) in cases.items():
        src = write_dir(tmp_path / layout, tensors, ct_config(fmt, **args))
        ckpt = checkpoints.load(src)
        q = ckpt.tensors["m.weight"]
        assert ckpt.scheme.weights == layout
        np.testing.assert_array_equal(decoded(q), want.astype(np.float32))
        checkpoints.save(tmp_path / f"{layout}_out", ckpt.tensors, ckpt.scheme)
        assert raw_tensors(tmp_path / f"{layout}_out") == raw_tensors(src)


def test_modelopt_nvfp4(tmp_path):
    """ModelOpt NVFP4 (hf_quant_config.json): weight_scale_2 is the decode factor, copied."""
    packed, values = packed_fp4((32, 24))
    s4 = RNG.uniform(0.01, 400, (32, 3)).astype(E4M3)
    ws2 = np.array(3e-4, np.float32)
    hf_quant = {
        "producer": {"name": "modelopt"},
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []},
    }
    tensors = {
        "m.weight": packed,
        "m.weight_scale": s4,
        "m.weight_scale_2": ws2,
        "m.input_scale": np.array(0.5, np.float32),
    }
    src = write_dir(tmp_path / "src", tensors, hf_quant=hf_quant)
    ckpt = checkpoints.load(src)
    q = ckpt.tensors["m.weight"]
    assert (q.fmt, float(q.global_scale)) == ("nvfp4", float(ws2))
    want = (values * np.repeat(s4.astype(np.float32), 16, -1)) * ws2
    np.testing.assert_array_equal(decoded(q), want)
    assert float(ckpt.tensors["m.input_scale"]) == 0.5
    checkpoints.save(tmp_path / "out", ckpt.tensors, ckpt.scheme)
    assert raw_tensors(tmp_path / "out") == raw_tensors(src)
    assert (
        json.loads((tmp_path / "out/hf_quant_config.json").read_text())["quantization"][
            "quant_algo"
        ]
        == "NVFP4"
    )


def test_gpt_oss_stacked_experts_in_shards(tmp_path):
    """gpt-oss MXFP4 experts ``[E, out, in/32, 16]`` bytes and ``[E, out, in/32]`` E8M0 scales,
    over three shards with an index; written back in several shards."""
    e, out, groups = 3, 8, 2
    blocks, values = packed_fp4((e, out, groups, 16))
    scales = RNG.integers(110, 135, (e, out, groups), dtype=np.uint8)
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj_blocks": blocks,
        "model.layers.0.mlp.experts.gate_up_proj_scales": scales,
        "model.layers.0.mlp.experts.gate_up_proj_bias": np.ones((e, out), ml_dtypes.bfloat16),
        "model.layers.0.mlp.router.weight": np.ones((e, 64), ml_dtypes.bfloat16),
    }
    src = write_dir(tmp_path / "src", tensors, {"quant_method": "mxfp4"}, shards=3)
    ckpt = checkpoints.load(src)
    q = ckpt.tensors["model.layers.0.mlp.experts.gate_up_proj"]
    assert (q.fmt, q.shape) == ("mxfp4", (e, out, 64))
    want = values.reshape(e, out, 64) * np.repeat(pow2_of(scales), 32, -1)
    np.testing.assert_array_equal(decoded(q), want)
    checkpoints.save(tmp_path / "out", ckpt.tensors, ckpt.scheme, max_shard_bytes=200)
    assert (tmp_path / "out/model.safetensors.index.json").exists()
    assert raw_tensors(tmp_path / "out") == raw_tensors(src)
    assert checkpoints.load(tmp_path / "out").tensors.keys() == ckpt.tensors.keys()


def test_jaxmx_quantized_weights_save_and_load(tmp_path):
    """Weights jaxmx quantized, saved in each scheme and loaded back: the same MXArray bytes."""
    w = jax.random.normal(jax.random.key(0), (48, 64), jnp.float32)
    cases = [
        (
            Scheme(method="fp8", weights="block", block_size=(16, 32)),
            jaxmx.quantize(w, "fp8_e4m3_block", tile=(16, 32)),
        ),
        (
            Scheme(method="fp8", weights="block", scale_dtype="ue8m0"),
            jaxmx.quantize(w, "fp8_e4m3_block", tile=(128, 128), scale_mode="pow2"),
        ),
        (Scheme(method="mxfp8", weights="mxfp8"), jaxmx.quantize(w, "mxfp8_e4m3")),
        (Scheme(method="compressed-tensors", weights="mxfp4"), jaxmx.quantize(w, "mxfp4")),
        (Scheme(method="modelopt", weights="nvfp4"), jaxmx.quantize(w, "nvfp4")),
        (
            Scheme(method="compressed-tensors", weights="channel", scale_dtype="float32"),
            jaxmx.quantize(w, "fp8_e4m3_block", tile=(1, 64)),
        ),
    ]
    for i, (scheme, q) in enumerate(cases):
        checkpoints.save(tmp_path / str(i), {"m.weight": q}, scheme)
        back = checkpoints.load(tmp_path / str(i)).tensors["m.weight"]
        for leaf, want in zip(jax.tree.leaves(back), jax.tree.leaves(q), strict=True):
            np.testing.assert_array_equal(
                np.asarray(leaf).view(np.uint8) if leaf.dtype.itemsize == 1 else leaf,
                np.asarray(want).view(np.uint8) if want.dtype.itemsize == 1 else want,
            )


def test_sharded_load_places_each_slice(tmp_path):
    """With a NamedSharding, each device receives its slice of codes and scales."""
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    q = jaxmx.quantize(jnp.ones((128, 64)), "mxfp8_e4m3")
    checkpoints.save(
        tmp_path,
        {"m.weight": q, "norm.weight": jnp.ones((8, 4))},
        Scheme(method="mxfp8", weights="mxfp8"),
    )
    lines = []
    ckpt = checkpoints.load(tmp_path, sharding=sharding, progress=lines.append)
    loaded = ckpt.tensors["m.weight"]
    assert loaded.data.sharding == sharding and loaded.scale.sharding == sharding
    assert {s.data.shape for s in loaded.data.addressable_shards} == {(32, 64)}
    assert {s.data.shape for s in ckpt.tensors["norm.weight"].addressable_shards} == {(2, 4)}
    assert lines == ["reading shard 1/1: model.safetensors"]


# -- errors ------------------------------------------------------------------------------------


def test_malformed_checkpoints_name_the_tensor(tmp_path):
    codes = e4m3_codes((256, 256))
    scale = np.ones((2, 2), np.float32)

    def refused(tensors, qc, match, **kwargs):
        path = write_dir(tmp_path / f"case{len(list(tmp_path.iterdir()))}", tensors, qc, **kwargs)
        with pytest.raises(CheckpointError, match=match):
            checkpoints.load(path)

    refused({"m.weight": codes}, {"quant_method": "awq"}, "quant_method 'awq'")
    refused(
        {"m.weight": codes},
        FP8_BLOCK,
        r"'m\.weight' is float8_e4m3fn but its scale "
        r"'m\.weight_scale_inv' is missing",
    )
    refused({"m.weight": codes}, None, "declares no quantization_config")
    refused(
        {"m.weight": codes, "m.weight_scale_inv": np.ones((2, 3), np.float32)},
        FP8_BLOCK,
        r"m\.weight's scales: expected shape \[2, 2\], got \[2, 3\]",
    )
    refused(
        {"m.weight": codes, "m.weight_scale_inv": scale},
        {**FP8_BLOCK, "weight_block_size": [100, 128]},
        r"m\.weight's scales: expected shape \[3, 2\]",
    )
    refused({"n.weight_scale_inv": scale}, FP8_BLOCK, r"'n\.weight_scale_inv' has no weight")
    refused(
        {"m.weight": codes.astype(np.float32), "m.weight_scale_inv": scale},
        FP8_BLOCK,
        "expected float8_e4m3fn values, got float32",
    )
    b = np.full((2, 2), 255, np.uint8)
    refused(
        {"m.weight": codes, "m.weight_scale_inv": b},
        {**FP8_BLOCK, "scale_fmt": "ue8m0"},
        r"m\.weight's scales: E8M0 byte 0xFF",
    )
    packed, _ = packed_fp4((4, 12))
    nv = ct_config("nvfp4-pack-quantized", num_bits=4, strategy="tensor_group", group_size=16)
    refused(
        {
            "m.weight_packed": packed,
            "m.weight_scale": np.ones((4, 2), E4M3),
            "m.weight_global_scale": np.ones(1, np.float32),
        },
        nv,
        r"in \(24\) divisible by their block \(16\)",
    )
    refused(
        {"m.weight_packed": packed_fp4((4, 16))[0], "m.weight_scale": np.ones((4, 2), E4M3)},
        nv,
        r"tensor scale 'm\.weight_global_scale' is missing",
    )
    refused(
        {
            "m.weight_packed": packed_fp4((4, 16))[0],
            "m.weight_scale": np.ones((4, 2), E4M3),
            "m.weight_global_scale": np.array([7.0], np.float32),
        },
        nv,  # 1 / (1 / 7) != 7
        r"m\.weight's tensor scale: the global scale 7\.0",
    )
    asym = ct_config("float-quantized", num_bits=8, strategy="channel")
    asym["config_groups"]["group_0"]["weights"]["symmetric"] = False
    refused({"m.weight": codes}, asym, "asymmetric weights")
    status = {
        **ct_config("float-quantized", num_bits=8, strategy="tensor"),
        "quantization_status": "frozen",
    }
    refused({"m.weight": codes}, status, "quantization_status 'frozen'")
    path = write_dir(tmp_path / "shards", {"a": scale, "b": scale}, None, shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"shard 'model-00002-of-00002.safetensors' \(holding 'b'"
    ):
        checkpoints.load(path)


def test_writes_a_reader_would_misread_are_refused(tmp_path):
    w = jax.random.normal(jax.random.key(1), (64, 64))
    fp32 = jaxmx.quantize(w, "fp8_e4m3_block", tile=(128, 128))
    with pytest.raises(CheckpointError, match="ue8m0 stores powers of two"):
        checkpoints.save(
            tmp_path, {"m.weight": fp32}, Scheme(method="fp8", weights="block", scale_dtype="ue8m0")
        )
    with pytest.raises(CheckpointError, match="not exact in bfloat16"):
        checkpoints.save(
            tmp_path, {"m.weight": fp32}, Scheme(method="compressed-tensors", weights="block")
        )
    with pytest.raises(CheckpointError, match="stores nvfp4 weights, got mxfp4"):
        checkpoints.save(
            tmp_path,
            {"m.weight": jaxmx.quantize(w, "mxfp4")},
            Scheme(method="modelopt", weights="nvfp4"),
        )
    with pytest.raises(
        CheckpointError, match=r"takes? \(128, 128\) tiles, the MXArray has \(32, 32\)"
    ):
        checkpoints.save(
            tmp_path,
            {"m.weight": jaxmx.quantize(w, "fp8_e4m3_block", tile=(32, 32))},
            Scheme(method="fp8", weights="block"),
        )
    with pytest.raises(CheckpointError, match="would misread this one"):
        q = jaxmx.quantize(jnp.ones((200, 256)), "fp8_e4m3_block", tile=(128, 128))
        checkpoints.save(tmp_path, {"m.weight": q}, Scheme(method="fp8", weights="block"))
    with pytest.raises(CheckpointError, match="needs a Scheme"):
        checkpoints.save(tmp_path, {"m.weight": fp32})


# -- requantize after load ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt, tile, mode",
    [
        ("mxfp8_e4m3", None, None),
        ("mxfp4", None, None),
        ("nvfp4", None, None),
        ("fp8_e4m3_block", (128, 128), "fp32"),
        ("fp8_e4m3_block", (128, 128), "pow2"),
        ("fp8_e4m3_block", (1, 96), "fp32"),
        ("fp8_e4m3_block", (256, 96), "fp32"),
    ],
)
def test_requantize_keeps_the_scales_a_fresh_quantization_lowers(fmt, tile, mode):
    """Decoded, then quantized again: a fresh quantization moves some scales (the one-step-lower
    rceil scale of a block whose decoded maximum fell to half the element maximum times its
    scale), ``requantize`` against the loaded scales returns every code and scale."""
    x = jax.random.normal(jax.random.key(2), (256, 96)) * jnp.exp(
        jax.random.normal(jax.random.key(3), (256, 1))
    )
    q = jaxmx.quantize(x, fmt, tile=tile, scale_mode=mode)
    f = q.format
    w = jaxmx.dequantize(q, jnp.bfloat16 if fmt != "fp8_e4m3_block" else jnp.float32)
    again = jaxmx.requantize(w, q)
    np.testing.assert_array_equal(
        np.asarray(again.data).view(np.uint8), np.asarray(q.data).view(np.uint8)
    )
    np.testing.assert_array_equal(np.asarray(again.scale), np.asarray(q.scale))
    if f.is_mx:  # the drift of the naive path, on the same data: scales one step lower
        fresh = jaxmx.quantize(w, fmt)
        old, new = (np.asarray(r.scale.astype(jnp.float32)) for r in (q, fresh))
        assert (new < old).mean() > {"mxfp8_e4m3": 0.02, "mxfp4": 0.1}[fmt]
        assert (new <= old).all()
    if f.has_global_scale:  # NVFP4: the tensor scale of the decoded amax differs
        assert float(jaxmx.quantize(w, fmt).global_scale) != float(q.global_scale)


def test_requantize_rescales_only_outgrown_blocks():
    q = jaxmx.quantize(jnp.ones((4, 64)), "mxfp8_e4m3")
    w = jaxmx.dequantize(q).at[2, 40].set(1e4)
    r = jaxmx.requantize(w, q)
    changed = np.asarray(r.scale.astype(jnp.float32) != q.scale.astype(jnp.float32))
    assert changed.tolist() == [[False, False], [False, False], [False, True], [False, False]]
    assert float(jaxmx.dequantize(r)[2, 40]) == 10240  # rceil scale 32: 312.5 -> 320
    with pytest.raises(ValueError, match="1 blocks outgrew"):
        jaxmx.requantize(w, q, outgrown="raise")


def test_inexact_nvfp4_encode_factor_is_kept_and_written_back(tmp_path):
    """A compressed-tensors NVFP4 global scale without an exact float32 reciprocal (7.0):
    refused by default; with ``inexact_tensor_scales="warn"`` loaded as its nearest reciprocal,
    with a warning naming it, and kept beside the MXArray so that save writes its bytes back."""
    packed, _ = packed_fp4((4, 16))
    s4 = np.full((4, 2), 2.0, E4M3)
    tensors = {"m.weight_packed": packed, "m.weight_scale": s4,
               "m.weight_global_scale": np.array([7.0], np.float32)}  # fmt: skip
    nv = ct_config("nvfp4-pack-quantized", num_bits=4, strategy="tensor_group", group_size=16)
    src = write_dir(tmp_path / "src", tensors, nv)
    with pytest.raises(CheckpointError, match="inexact_tensor_scales='warn'"):
        checkpoints.load(src)
    with pytest.warns(UserWarning, match=r"m\.weight's tensor scale: the global scale 7\.0"):
        ckpt = checkpoints.load(src, inexact_tensor_scales="warn")
    assert float(ckpt.tensors["m.weight"].global_scale) == np.float32(1) / np.float32(7)
    assert float(ckpt.tensors["m.weight_global_scale"][0]) == 7.0
    checkpoints.save(tmp_path / "out", ckpt.tensors, ckpt.scheme)
    assert raw_tensors(tmp_path / "out") == raw_tensors(src)
