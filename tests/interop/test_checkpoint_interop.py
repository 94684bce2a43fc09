"""jaxmx.checkpoints against the peers' own writers and readers (tests/interop/peers.py): a
checkpoint the peer wrote loads into jaxmx with values equal to the peer's dequantization, and
jaxmx writes it back byte for byte, which the peer reads to the same values; weights jaxmx
quantized and wrote are read by the peer to jaxmx's values."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import peers
import pytest
from safetensors.numpy import save_file
from safetensors_bytes import raw_tensors

import jaxmx
from jaxmx import checkpoints
from jaxmx.checkpoints import Scheme

pytestmark = pytest.mark.interop

RNG = np.random.default_rng(0)


def weights(*shapes):
    """``{"model.layers.{i}.mlp.proj": float32 [out, in]}``, rows of differing magnitudes."""
    return {
        f"model.layers.{i}.mlp.proj": (
            RNG.standard_normal(s) * np.exp(RNG.standard_normal((s[0], 1)))
        ).astype(np.float32)
        for i, s in enumerate(shapes)
    }


def jaxmx_values(ckpt, names, dtype) -> dict[str, np.ndarray]:
    """jaxmx's dequantization of the quantized weights, in the peer's output dtype, as float32
    (a weight the peer left unquantized, as it is)."""
    return {
        n: np.asarray(
            jaxmx.dequantize(t, dtype).astype(jnp.float32)
            if isinstance(t := ckpt.tensors[n], jaxmx.MXArray)
            else t
        )
        for n in names
    }


# compressed-tensors' decompress output dtype per preset (peers.dequantize_compressed_tensors)
CT_CASES = {
    "FP8": ((48, 64), (40, 96)),
    "FP8_DYNAMIC": ((48, 64), (40, 96)),
    "FP8_BLOCK": ((200, 256), (64, 96), (129, 300)),
    "MXFP8": ((48, 64), (40, 96)),
    "MXFP4": ((48, 64), (40, 96)),
    "NVFP4": ((48, 64), (40, 96)),
    "NVFP4A16": ((48, 64),),
}
CT_DTYPES = {
    "MXFP8": jnp.bfloat16,
    "MXFP4": jnp.bfloat16,
    "NVFP4": jnp.bfloat16,
    "NVFP4A16": jnp.bfloat16,
}


@pytest.mark.parametrize("preset", list(CT_CASES))
def test_compressed_tensors_round_trip(tmp_path, preset):
    """peer -> jaxmx -> peer: values equal CT's decompression, the bytes written back equal
    CT's file, and CT reads jaxmx's file to the same values."""
    w = weights(*CT_CASES[preset])
    extra = {"model.embed_tokens.weight": RNG.standard_normal((16, 64)).astype(np.float32)}
    peers.write_compressed_tensors(tmp_path / "peer", w, preset, extra=extra)
    want = peers.dequantize_compressed_tensors(tmp_path / "peer")
    ckpt = checkpoints.load(tmp_path / "peer", inexact_tensor_scales="warn")
    got = jaxmx_values(ckpt, want, CT_DTYPES.get(preset, jnp.float32))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    checkpoints.save(tmp_path / "jaxmx", ckpt.tensors, ckpt.scheme, config=ckpt.config)
    assert raw_tensors(tmp_path / "jaxmx") == raw_tensors(tmp_path / "peer")
    again = peers.dequantize_compressed_tensors(tmp_path / "jaxmx")
    for name in want:
        np.testing.assert_array_equal(again[name], want[name], err_msg=name)


@pytest.mark.parametrize(
    "preset, scheme, fmt, tile",
    [
        (
            "FP8_DYNAMIC",
            Scheme(method="compressed-tensors", weights="channel", scale_dtype="float32"),
            "fp8_e4m3_block",
            (1, 64),
        ),
        ("MXFP8", Scheme(method="compressed-tensors", weights="mxfp8"), "mxfp8_e4m3", None),
        ("MXFP4", Scheme(method="compressed-tensors", weights="mxfp4"), "mxfp4", None),
        ("NVFP4A16", Scheme(method="compressed-tensors", weights="nvfp4"), "nvfp4", None),
    ],
)
def test_jaxmx_writes_compressed_tensors(tmp_path, preset, scheme, fmt, tile):
    """jaxmx -> peer: weights jaxmx quantized, written with a config jaxmx made, decompressed by
    CT to jaxmx's values."""
    x = jnp.asarray(weights((48, 64))["model.layers.0.mlp.proj"])
    q = jaxmx.quantize(x, fmt, tile=tile, scale_mode="fp32" if tile else None)
    if fmt == "nvfp4":  # an encode factor with an exact reciprocal
        q = jaxmx.quantize(x, fmt, global_scale=jnp.float32(2.0**-7))
    checkpoints.save(tmp_path, {"model.layers.0.mlp.proj.weight": q}, scheme)
    got = peers.dequantize_compressed_tensors(tmp_path)["model.layers.0.mlp.proj.weight"]
    dtype = CT_DTYPES.get(preset, jnp.float32)
    np.testing.assert_array_equal(got, np.asarray(jaxmx.dequantize(q, dtype).astype(jnp.float32)))


@pytest.mark.parametrize(
    "block, scale_fmt", [((128, 128), "float"), ((128, 128), "ue8m0"), (None, "float")]
)
def test_transformers_fp8_round_trip(tmp_path, block, scale_fmt):
    """transformers' fine-grained FP8 (DeepSeek / Qwen layout), written by transformers'
    quantizer, on shapes that do not divide the block: jaxmx's values equal transformers'
    dequantization, the file written back is byte-identical, and transformers' loader reads
    jaxmx's file to the same values."""
    shapes = ((256, 384), (200, 256)) if block else ((48, 64),)
    peers.write_fp8_transformers(
        tmp_path / "peer", weights(*shapes), block_size=block, scale_fmt=scale_fmt
    )
    want = peers.dequantize_fp8_transformers(tmp_path / "peer")
    ckpt = checkpoints.load(tmp_path / "peer")
    got = jaxmx_values(ckpt, want, jnp.float32)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    checkpoints.save(tmp_path / "jaxmx", ckpt.tensors, ckpt.scheme, config=ckpt.config)
    assert raw_tensors(tmp_path / "jaxmx") == raw_tensors(tmp_path / "peer")


def test_jaxmx_writes_transformers_fp8(tmp_path):
    """jaxmx -> transformers' loader: block FP8 with float32 and with ue8m0 scales (shapes that
    divide the block: transformers' loader infers the block from the scale grid)."""
    x = jnp.asarray(weights((256, 384))["model.layers.0.mlp.proj"])
    for scale_dtype, mode in (("float32", "fp32"), ("ue8m0", "pow2")):
        q = jaxmx.quantize(x, "fp8_e4m3_block", tile=(128, 128), scale_mode=mode)
        path = tmp_path / scale_dtype
        scheme = Scheme(method="fp8", weights="block", scale_dtype=scale_dtype)
        checkpoints.save(
            path,
            {"model.layers.0.mlp.proj.weight": q},
            scheme,
            config={"model_type": "llama", "dtype": "float32"},
        )
        got = peers.load_with_transformers_fp8(path)["model.layers.0.mlp.proj.weight"]
        np.testing.assert_array_equal(got, np.asarray(jaxmx.dequantize(q)))


def test_gpt_oss_mxfp4_experts(tmp_path):
    """gpt-oss MXFP4 experts: jaxmx's values equal transformers' ``convert_moe_packed_tensors``
    (transposed back), bytes written back identical, over two shards."""
    e, out, groups = 4, 16, 3
    blocks = RNG.integers(0, 256, (e, out, groups, 16), dtype=np.uint8)
    scales = RNG.integers(115, 135, (e, out, groups), dtype=np.uint8)
    tensors = {
        "model.layers.0.mlp.experts.down_proj_blocks": blocks,
        "model.layers.0.mlp.experts.down_proj_scales": scales,
        "model.layers.0.mlp.experts.down_proj_bias": np.zeros((e, out), ml_dtypes.bfloat16),
    }
    path = tmp_path / "peer"
    path.mkdir()
    save_file(dict(list(tensors.items())[:2]), str(path / "model-00001-of-00002.safetensors"))
    save_file(dict(list(tensors.items())[2:]), str(path / "model-00002-of-00002.safetensors"))
    (path / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    n: f"model-0000{1 + (i >= 2)}-of-00002.safetensors"
                    for i, n in enumerate(tensors)
                }
            }
        )
    )
    (path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "mxfp4"}})
    )
    ckpt = checkpoints.load(path)
    q = ckpt.tensors["model.layers.0.mlp.experts.down_proj"]
    want = peers.dequantize_gpt_oss_mxfp4(blocks, scales)
    np.testing.assert_array_equal(np.asarray(jaxmx.dequantize(q)), want)
    checkpoints.save(tmp_path / "jaxmx", ckpt.tensors, ckpt.scheme, max_shard_bytes=1024)
    assert raw_tensors(tmp_path / "jaxmx") == raw_tensors(path)


def test_modelopt_nvfp4_against_the_compressed_tensors_converter(tmp_path):
    """ModelOpt NVFP4 written by jaxmx (a weight_scale_2 decode factor whose reciprocal is
    exact), converted by compressed-tensors' own ModelOpt converter and decompressed by CT: the
    same values as jaxmx's; jaxmx reads CT's converted file to the same MXArray."""
    x = jnp.asarray(weights((48, 64))["model.layers.0.mlp.proj"])
    q = jaxmx.quantize(x, "nvfp4", global_scale=jnp.float32(2.0**-6))
    checkpoints.save(
        tmp_path / "modelopt",
        {"model.layers.0.mlp.proj.weight": q, "model.embed_tokens.weight": jnp.ones((8, 64))},
        Scheme(method="modelopt", weights="nvfp4"),
        config={"model_type": "llama"},
    )
    peers.modelopt_to_compressed_tensors(tmp_path / "modelopt", tmp_path / "ct")
    want = peers.dequantize_compressed_tensors(tmp_path / "ct")["model.layers.0.mlp.proj.weight"]
    np.testing.assert_array_equal(
        want, np.asarray(jaxmx.dequantize(q, jnp.bfloat16).astype(jnp.float32))
    )
    back = checkpoints.load(tmp_path / "ct").tensors["model.layers.0.mlp.proj.weight"]
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(q), strict=True):
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1 else np.asarray(a),
            np.asarray(b).view(np.uint8) if b.dtype.itemsize == 1 else np.asarray(b),
        )


def test_transformers_mxfp8(tmp_path):
    """transformers' MXFP8 layout (fine-grained FP8 in [1, 32] blocks of E8M0 scales): written by
    transformers' quantizer, loaded by jaxmx to transformers' values and written back byte for
    byte; jaxmx's ``mxfp8`` checkpoint read by transformers' loader to jaxmx's values."""
    w = weights((48, 64), (40, 96))
    peers.write_fp8_transformers(tmp_path / "peer", w, block_size=(1, 32), scale_fmt="ue8m0")
    want = peers.dequantize_fp8_transformers(tmp_path / "peer")
    ckpt = checkpoints.load(tmp_path / "peer")
    assert (ckpt.scheme.block_size, ckpt.scheme.scale_dtype) == ((1, 32), "ue8m0")
    got = jaxmx_values(ckpt, want, jnp.float32)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    checkpoints.save(tmp_path / "jaxmx", ckpt.tensors, ckpt.scheme, config=ckpt.config)
    assert raw_tensors(tmp_path / "jaxmx") == raw_tensors(tmp_path / "peer")

    q = jaxmx.quantize(jnp.asarray(w["model.layers.1.mlp.proj"]), "mxfp8_e4m3")
    checkpoints.save(
        tmp_path / "mx",
        {"model.layers.1.mlp.proj.weight": q},
        Scheme(method="mxfp8", weights="mxfp8"),
        config={"model_type": "llama", "dtype": "float32"},
    )
    got = peers.load_with_transformers_fp8(tmp_path / "mx")["model.layers.1.mlp.proj.weight"]
    np.testing.assert_array_equal(got, np.asarray(jaxmx.dequantize(q)))
