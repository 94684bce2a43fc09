"""The peer helpers (tests/interop/peers.py) against the facts of CHECKPOINT_FORMATS.md.

Every expectation here is computed with numpy + ml_dtypes from the raw bytes of the files, which
are read (and, for hand-made checkpoints, written) by a small safetensors parser in this file, so
the peers' code is checked against the fact sheet and not against itself.
"""

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import peers
import pytest

pytestmark = pytest.mark.interop

F32 = np.float32
BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], F32)
MLP = "model.layers.0.mlp"

# ---------------------------------------------------------------------------- safetensors in numpy

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": BF16,
    "F8_E4M3": E4M3,
    "F8_E8M0": E8M0,
    "U8": np.uint8,
    "I8": np.int8,
    "I32": np.int32,
    "I64": np.int64,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def read_raw(path) -> dict[str, np.ndarray]:
    """Every tensor of every ``*.safetensors`` file in ``path``, parsed from the bytes."""
    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        data = file.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        header.pop("__metadata__", None)
        for name, info in header.items():
            start, end = info["data_offsets"]
            raw = data[8 + n + start : 8 + n + end]
            out[name] = np.frombuffer(raw, _DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def write_raw(path, tensors: dict[str, np.ndarray], config: dict) -> None:
    """A hand-made checkpoint: ``model.safetensors`` (safetensors layout) and ``config.json``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        blob = np.ascontiguousarray(a).tobytes()
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    body = len(text).to_bytes(8, "little") + text + b"".join(blobs)
    (path / "model.safetensors").write_bytes(body)
    (path / "config.json").write_text(json.dumps(config))


def config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """E2M1 codes two a byte, element 2j in the low nibble of byte j."""
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1)
    return codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def e8m0(b: np.ndarray) -> np.ndarray:
    return np.ldexp(F32(1), b.astype(np.int32) - 127).astype(F32)


def expand(scale: np.ndarray, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    """Scale of element [i, j] = scale[i // bh, j // bw], cropped to ``shape``."""
    s = np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)
    return s[: shape[0], : shape[1]]


def block_amax(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
    out = np.zeros((rows, cols), F32)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            out[i, j] = np.abs(tile).max()
    return out


def weights(seed: int, *shapes, dtype=F32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    names = ("down_proj", "up_proj", "gate_proj")
    return {
        f"{MLP}.{n}": rng.standard_normal(s).astype(F32).astype(dtype)
        for n, s in zip(names, shapes, strict=False)
    }


# ---------------------------------------------------------------------------- compressed-tensors


def ct_group(path) -> dict:
    qc = config(path)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["quantization_status"] == "compressed"
    (group,) = qc["config_groups"].values()
    return group


@pytest.mark.parametrize("scheme", ["FP8", "FP8_DYNAMIC"])
def test_ct_fp8_tensor_and_channel(tmp_path, scheme):
    ws = weights(0, (64, 96), (200, 256))
    peers.write_compressed_tensors(tmp_path, ws, scheme)
    raw, deq = read_raw(tmp_path), peers.dequantize_compressed_tensors(tmp_path)
    native = peers._decompress_compressed_tensors_native(tmp_path)
    group = ct_group(tmp_path)
    assert group["format"] == "float-quantized"
    assert group["weights"]["strategy"] == ("tensor" if scheme == "FP8" else "channel")
    for name, w in ws.items():
        q, s = raw[f"{name}.weight"], raw[f"{name}.weight_scale"]
        assert q.dtype == E4M3 and q.shape == w.shape
        assert s.dtype == F32  # the model dtype (float32 model)
        assert f"{name}.weight_zero_point" not in raw  # symmetric: dropped on compression
        if scheme == "FP8":
            assert s.shape == (1,)
            np.testing.assert_array_equal(s, np.abs(w).max() / F32(448))
            assert raw[f"{name}.input_scale"].shape == (1,)  # static input
        else:
            assert s.shape == (w.shape[0], 1)
            np.testing.assert_array_equal(s, np.abs(w).max(axis=1, keepdims=True) / F32(448))
            assert f"{name}.input_scale" not in raw  # dynamic per-token input
        np.testing.assert_array_equal(q, np.clip(w / s, -448, 448).astype(E4M3))
        np.testing.assert_array_equal(deq[f"{name}.weight"], q.astype(F32) * s)
        assert str(native[f"{name}.weight"].dtype) == "torch.float32"


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_ct_fp8_block_non_divisible(tmp_path, dtype):
    ws = weights(1, (200, 256), (64, 96), dtype=dtype)
    peers.write_compressed_tensors(tmp_path, ws, "FP8_BLOCK")
    raw, deq = read_raw(tmp_path), peers.dequantize_compressed_tensors(tmp_path)
    native = peers._decompress_compressed_tensors_native(tmp_path)
    group = ct_group(tmp_path)
    assert group["weights"]["strategy"] == "block"
    assert group["weights"]["block_structure"] == [128, 128]
    assert group["input_activations"]["dynamic"] is True
    for name, w in ws.items():
        q, s = raw[f"{name}.weight"], raw[f"{name}.weight_scale"]
        assert s.dtype == np.dtype(dtype)  # the model dtype
        assert s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))  # [2, 2] and [1, 1]
        amax = block_amax(w.astype(F32), (128, 128)).astype(dtype)
        np.testing.assert_array_equal(s, (amax / dtype(448)).astype(dtype))
        s_full = expand(s, (128, 128), w.shape)
        np.testing.assert_array_equal(q, np.clip(w / s_full, -448, 448).astype(E4M3))
        # w[i, j] = q[i, j] * s[i // 128, j // 128], rounded to the model dtype
        expected = (q.astype(F32) * s_full.astype(F32)).astype(dtype)
        np.testing.assert_array_equal(deq[f"{name}.weight"], expected.astype(F32))
        assert str(native[f"{name}.weight"].dtype).endswith(
            "float32" if dtype == F32 else "bfloat16"
        )


@pytest.mark.parametrize("scheme", ["NVFP4", "NVFP4A16"])
def test_ct_nvfp4(tmp_path, scheme):
    ws = weights(2, (32, 64), (48, 32))
    peers.write_compressed_tensors(tmp_path, ws, scheme)
    raw, deq = read_raw(tmp_path), peers.dequantize_compressed_tensors(tmp_path)
    native = peers._decompress_compressed_tensors_native(tmp_path)
    group = ct_group(tmp_path)
    assert group["format"] == "nvfp4-pack-quantized"
    assert group["weights"]["strategy"] == "tensor_group" and group["weights"]["group_size"] == 16
    for name, w in ws.items():
        packed, s = raw[f"{name}.weight_packed"], raw[f"{name}.weight_scale"]
        g = raw[f"{name}.weight_global_scale"]
        assert packed.dtype == np.uint8 and packed.shape == (w.shape[0], w.shape[1] // 2)
        assert s.dtype == E4M3 and s.shape == (w.shape[0], w.shape[1] // 16)
        assert g.dtype == F32 and g.shape == (1,)
        assert (f"{name}.input_global_scale" in raw) == (scheme == "NVFP4")
        # the global scale is the encode factor 448 * 6 / amax(W), computed by torch's
        # `scalar / tensor` as 2688 * fl32(1 / amax) (one ulp off a true division at times)
        np.testing.assert_array_equal(g, F32(448 * 6) * (F32(1) / np.abs(w).max()))
        np.testing.assert_allclose(g, F32(448 * 6) / np.abs(w).max(), rtol=2e-7)
        group_amax = np.abs(w).reshape(w.shape[0], -1, 16).max(axis=-1)
        np.testing.assert_array_equal(s, (group_amax / F32(6) * g).astype(E4M3))
        # w = e2m1(code) * (float(weight_scale) / weight_global_scale), CT's result in bf16
        step = np.repeat(s.astype(F32) / g, 16, axis=1)
        codes = E2M1[unpack_fp4(packed)]
        np.testing.assert_array_equal(
            deq[f"{name}.weight"], (codes * step).astype(BF16).astype(F32)
        )
        assert np.all(np.abs(codes * step - w) <= step)  # the codes are w's (nibble order)
        assert str(native[f"{name}.weight"].dtype) == "torch.bfloat16"


def test_ct_nvfp4_nibble_order(tmp_path):
    w = np.zeros((16, 32), F32)
    w[0, :4] = [0.5, 1.0, -6.0, 0.0]  # amax 6: global scale 448, group scale 448, step 1
    peers.write_compressed_tensors(tmp_path, {f"{MLP}.down_proj": w}, "NVFP4A16")
    packed = read_raw(tmp_path)[f"{MLP}.down_proj.weight_packed"]
    assert list(packed[0, :2]) == [0x21, 0x0F]  # low nibble = even element
    np.testing.assert_array_equal(
        peers.dequantize_compressed_tensors(tmp_path)[f"{MLP}.down_proj.weight"], w
    )


def test_ct_nvfp4_needs_whole_groups(tmp_path):
    with pytest.raises(ValueError, match="group_size"):
        peers.write_compressed_tensors(tmp_path, weights(3, (16, 40)), "NVFP4")


@pytest.mark.parametrize("scheme", ["MXFP4", "MXFP8"])
def test_ct_mx(tmp_path, scheme):
    ws = weights(4, (16, 64), (8, 128))
    top = 7.0 if scheme == "MXFP4" else 448.0
    for w in ws.values():
        w[0, :32] = w[0, :32] / np.abs(w[0, :32]).max() * top  # group amax 7 / 448
    peers.write_compressed_tensors(tmp_path, ws, scheme)
    raw, deq = read_raw(tmp_path), peers.dequantize_compressed_tensors(tmp_path)
    native = peers._decompress_compressed_tensors_native(tmp_path)
    group = ct_group(tmp_path)
    assert group["format"] == ("mxfp4-pack-quantized" if scheme == "MXFP4" else "mxfp8-quantized")
    for name, w in ws.items():
        b = raw[f"{name}.weight_scale"]
        assert b.dtype == np.uint8 and b.shape == (w.shape[0], w.shape[1] // 32)
        assert not any(k.startswith(name) and "global" in k for k in raw)
        if scheme == "MXFP4":
            packed = raw[f"{name}.weight_packed"]
            assert packed.shape == (w.shape[0], w.shape[1] // 2)
            q = E2M1[unpack_fp4(packed)]
        else:
            q = raw[f"{name}.weight"].astype(F32)
            assert raw[f"{name}.weight"].dtype == E4M3
        s = np.repeat(e8m0(b), 32, axis=1)
        np.testing.assert_array_equal(deq[f"{name}.weight"], q * s)  # w = q * 2^(b - 127)
        # CT's writer rounds amax to one mantissa bit first: amax 7 -> 2^1 (OCP: 2^0),
        # and for MXFP8 amax 448 -> 2^1 (OCP: 2^0)
        assert b[0, 0] == 128
        assert str(native[f"{name}.weight"].dtype) == "torch.bfloat16"


def test_ct_extra_tensors_unquantized(tmp_path):
    rng = np.random.default_rng(5)
    extra = {
        "model.embed_tokens.weight": rng.standard_normal((10, 64)).astype(BF16),
        "model.norm.weight": rng.standard_normal(64).astype(F32),
    }
    ws = weights(6, (32, 64))
    for scheme in ("FP8_BLOCK", "NVFP4"):
        peers.write_compressed_tensors(tmp_path / scheme, ws, scheme, extra=extra)
        raw = read_raw(tmp_path / scheme)
        for name, value in extra.items():
            assert raw[name].dtype == value.dtype
            np.testing.assert_array_equal(raw[name], value)
        assert set(peers.dequantize_compressed_tensors(tmp_path / scheme)) == {
            f"{MLP}.down_proj.weight"
        }


# ---------------------------------------------------------------------------- ModelOpt via CT


def test_modelopt_nvfp4_through_ct_converter(tmp_path):
    rng = np.random.default_rng(7)
    name = f"{MLP}.down_proj"
    packed = rng.integers(0, 256, (32, 32), dtype=np.uint8)
    ws = rng.uniform(0.5, 400, (32, 4)).astype(E4M3)
    ws2, input_scale = np.array(3e-4, F32), np.array(0.02, F32)
    lm_head = rng.standard_normal((10, 64)).astype(BF16)
    write_raw(
        tmp_path / "modelopt",
        {
            f"{name}.weight": packed,
            f"{name}.weight_scale": ws,
            f"{name}.weight_scale_2": ws2,
            f"{name}.input_scale": input_scale,
            "lm_head.weight": lm_head,
        },
        {"model_type": "llama", "dtype": "bfloat16"},
    )
    peers.modelopt_to_compressed_tensors(tmp_path / "modelopt", tmp_path / "ct")
    raw = read_raw(tmp_path / "ct")
    qc = config(tmp_path / "ct")["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized" and qc["quantization_status"] == "compressed"
    assert "lm_head" in qc["ignore"]
    np.testing.assert_array_equal(raw[f"{name}.weight_packed"], packed)  # bytes unchanged
    np.testing.assert_array_equal(raw[f"{name}.weight_scale"], ws)
    g = raw[f"{name}.weight_global_scale"]
    assert g.shape == () and g == F32(1) / ws2  # encode factor: float32 reciprocal, 0-d
    assert raw[f"{name}.input_global_scale"] == F32(1) / input_scale
    np.testing.assert_array_equal(raw["lm_head.weight"], lm_head)
    assert f"{name}.weight" not in raw and f"{name}.weight_scale_2" not in raw

    deq = peers.dequantize_compressed_tensors(tmp_path / "ct")
    assert set(deq) == {f"{name}.weight"}
    codes = E2M1[unpack_fp4(packed)]
    # The converted global scale is 0-d, so torch's promotion keeps `bf16 scale / f32 global` in
    # bf16: CT computes bf16(e2m1 * bf16(weight_scale / weight_global_scale)), two roundings
    # (a CT-native [1]-shaped global scale gives one, see test_ct_nvfp4)
    step = np.repeat((ws.astype(F32) / g).astype(BF16).astype(F32), 16, axis=1)
    np.testing.assert_array_equal(deq[f"{name}.weight"], (codes * step).astype(BF16).astype(F32))
    # ModelOpt's own reading, w = e2m1 * weight_scale * weight_scale_2, agrees to bf16 roundings
    modelopt = codes * np.repeat(ws.astype(F32), 16, axis=1) * ws2
    np.testing.assert_allclose(deq[f"{name}.weight"], modelopt, rtol=2**-7, atol=0)


# ---------------------------------------------------------------------------- transformers FP8


def fp8_config(block=(128, 128), dtype="float32", **extra) -> dict:
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    qc["weight_block_size"] = list(block) if block is not None else None
    return {"model_type": "jaxmx_interop", "dtype": dtype, "quantization_config": qc | extra}


def test_hf_fp8_float_scales(tmp_path):
    w = weights(8, (256, 384))[f"{MLP}.down_proj"]
    w[:128, :128] = 0  # an all-zero block gets scale 1
    w[128:, 256:] *= 50
    peers.write_fp8_transformers(tmp_path, {"m.proj": w})
    raw = read_raw(tmp_path)
    qc = config(tmp_path)["quantization_config"]
    assert qc == fp8_config()["quantization_config"]
    q, s = raw["m.proj.weight"], raw["m.proj.weight_scale_inv"]
    assert q.dtype == E4M3 and s.dtype == F32 and s.shape == (2, 3)
    amax = block_amax(w, (128, 128))
    multiplier = np.where(amax > 0, F32(448) / np.where(amax > 0, amax, 1), F32(1))
    # weight_scale_inv is the decode factor amax / 448 (stored as 1 / (448 / amax))
    np.testing.assert_array_equal(s, F32(1) / multiplier)
    np.testing.assert_allclose(s, np.where(amax > 0, amax / 448, 1), rtol=1e-7)
    assert s[0, 0] == 1
    np.testing.assert_array_equal(
        q, np.clip(w * expand(multiplier, (128, 128), w.shape), -448, 448).astype(E4M3)
    )
    expected = q.astype(F32) * expand(s, (128, 128), w.shape)
    np.testing.assert_array_equal(
        peers.dequantize_fp8_transformers(tmp_path)["m.proj.weight"], expected
    )
    np.testing.assert_array_equal(
        peers.load_with_transformers_fp8(tmp_path)["m.proj.weight"], expected
    )


def test_hf_fp8_ue8m0_scales(tmp_path):
    w = weights(9, (256, 256))[f"{MLP}.down_proj"]
    w[:128, :128] *= 4.56 / np.abs(w[:128, :128]).max()  # block amax 4.56
    peers.write_fp8_transformers(tmp_path, {"m.proj": w}, scale_fmt="ue8m0")
    raw = read_raw(tmp_path)
    assert config(tmp_path)["quantization_config"]["scale_fmt"] == "ue8m0"
    q, s = raw["m.proj.weight"], raw["m.proj.weight_scale_inv"]
    assert s.dtype == E8M0 and s.shape == (2, 2)
    b = s.view(np.uint8)
    assert b[0, 0] == 121  # 2^-6
    # powers of two, rounded up from amax / 448 so that nothing clips
    decode = s.astype(F32)
    np.testing.assert_array_equal(decode, e8m0(b))
    amax = block_amax(w, (128, 128))
    np.testing.assert_array_equal(decode, np.exp2(np.ceil(np.log2(F32(1) / (F32(448) / amax)))))
    s_full = expand(decode, (128, 128), w.shape)
    np.testing.assert_array_equal(q, (w / s_full).astype(E4M3))
    assert np.abs(w / s_full).max() <= 448
    expected = q.astype(F32) * s_full
    np.testing.assert_array_equal(
        peers.dequantize_fp8_transformers(tmp_path)["m.proj.weight"], expected
    )
    np.testing.assert_array_equal(
        peers.load_with_transformers_fp8(tmp_path)["m.proj.weight"], expected
    )


def test_hf_fp8_saver_skips_non_divisible_and_per_tensor(tmp_path):
    ws = weights(10, (200, 256), (64, 96))
    peers.write_fp8_transformers(tmp_path / "block", ws)
    raw = read_raw(tmp_path / "block")
    for name, w in ws.items():  # Fp8Quantize leaves them unquantized, with no scale
        assert raw[f"{name}.weight"].dtype == F32 and f"{name}.weight_scale_inv" not in raw
        np.testing.assert_array_equal(
            peers.dequantize_fp8_transformers(tmp_path / "block")[f"{name}.weight"], w
        )

    peers.write_fp8_transformers(tmp_path / "tensor", ws, block_size=None)
    raw = read_raw(tmp_path / "tensor")
    assert config(tmp_path / "tensor")["quantization_config"]["weight_block_size"] is None
    deq = peers.dequantize_fp8_transformers(tmp_path / "tensor")
    for name, w in ws.items():
        q, s = raw[f"{name}.weight"], raw[f"{name}.weight_scale_inv"]
        assert s.shape == (1, 1)  # the saver's whole-tensor block (FP8Linear allocates 0-d)
        np.testing.assert_allclose(s[0, 0], np.abs(w).max() / 448, rtol=1e-7)
        np.testing.assert_array_equal(deq[f"{name}.weight"], q.astype(F32) * s)


def test_hf_fp8_ceil_grid_pitfall(tmp_path):
    rng = np.random.default_rng(11)
    q = rng.uniform(-448, 448, (200, 256)).astype(E4M3)
    s = np.array([[1, 2], [4, 8]], F32)  # FP8Linear's ceil grid for [200, 256]
    write_raw(tmp_path / "a", {"m.proj.weight": q, "m.proj.weight_scale_inv": s}, fp8_config())
    right = q.astype(F32) * expand(s, (128, 128), q.shape)
    np.testing.assert_array_equal(
        peers.dequantize_fp8_transformers(tmp_path / "a")["m.proj.weight"], right
    )
    # the loader's Fp8Dequantize reads the grid as 100-row blocks: row 120 gets block-row 1's scale
    loaded = peers.load_with_transformers_fp8(tmp_path / "a")["m.proj.weight"]
    np.testing.assert_array_equal(loaded[:100], right[:100])
    np.testing.assert_array_equal(loaded[120], q[120].astype(F32) * np.repeat(s[1], 128))
    assert not np.array_equal(loaded[120], right[120])

    q = q[:129]
    write_raw(tmp_path / "b", {"m.proj.weight": q, "m.proj.weight_scale_inv": s}, fp8_config())
    np.testing.assert_array_equal(
        peers.dequantize_fp8_transformers(tmp_path / "b")["m.proj.weight"],
        q.astype(F32) * expand(s, (128, 128), q.shape),
    )
    with pytest.raises(ValueError, match="not divisible by scale grid"):
        peers.load_with_transformers_fp8(tmp_path / "b")


def test_hf_fp8_loader_details(tmp_path):
    rng = np.random.default_rng(12)
    q = rng.uniform(-448, 448, (128, 256)).astype(E4M3)
    b = np.array([[120, 130]], np.uint8)
    # raw uint8 ue8m0 bytes, read as 2^(b - 127)
    write_raw(
        tmp_path / "u8",
        {"m.proj.weight": q, "m.proj.weight_scale_inv": b},
        fp8_config(scale_fmt="ue8m0"),
    )
    expected = q.astype(F32) * expand(e8m0(b), (128, 128), q.shape)
    np.testing.assert_array_equal(
        peers.dequantize_fp8_transformers(tmp_path / "u8")["m.proj.weight"], expected
    )
    np.testing.assert_array_equal(
        peers.load_with_transformers_fp8(tmp_path / "u8")["m.proj.weight"], expected
    )

    # the loader casts to the model dtype (config.json's dtype), and renames DeepSeek-V4's `.scale`
    s = np.array([[0.01, 0.03]], F32)
    write_raw(
        tmp_path / "bf16", {"m.proj.weight": q, "m.proj.scale": s}, fp8_config(dtype="bfloat16")
    )
    loaded = peers.load_with_transformers_fp8(tmp_path / "bf16")
    expected = (q.astype(F32) * expand(s, (128, 128), q.shape)).astype(BF16).astype(F32)
    np.testing.assert_array_equal(loaded["m.proj.weight"], expected)

    # per tensor (weight_block_size null): FP8Linear's 0-d float32 scale
    s = np.array(0.02, F32)
    write_raw(
        tmp_path / "tensor", {"m.proj.weight": q, "m.proj.weight_scale_inv": s}, fp8_config(None)
    )
    expected = q.astype(F32) * s
    for read in (peers.dequantize_fp8_transformers, peers.load_with_transformers_fp8):
        np.testing.assert_array_equal(read(tmp_path / "tensor")["m.proj.weight"], expected)

    # byte 255: +inf through the loader's uint8 path, NaN once viewed as float8_e8m0fnu
    b = np.array([[255, 127]], np.uint8)
    write_raw(
        tmp_path / "255",
        {"m.proj.weight": q, "m.proj.weight_scale_inv": b},
        fp8_config(scale_fmt="ue8m0"),
    )
    loaded = peers.load_with_transformers_fp8(tmp_path / "255")["m.proj.weight"]
    viewed = peers.dequantize_fp8_transformers(tmp_path / "255")["m.proj.weight"]
    nonzero = q[:, :128].astype(F32) != 0
    assert np.all(np.isinf(loaded[:, :128][nonzero])) and np.all(np.isnan(viewed[:, :128]))


# ---------------------------------------------------------------------------- gpt-oss MXFP4


def test_gpt_oss_mxfp4():
    rng = np.random.default_rng(13)
    blocks = rng.integers(0, 256, (2, 3, 2, 16), dtype=np.uint8)
    scales = rng.integers(118, 136, (2, 3, 2), dtype=np.uint8)
    blocks[0, 0, 0, 0], scales[0, 0, 0] = 0x21, 127
    scales[0, 1, 0], scales[0, 2, 0] = 128, 125
    out = peers.dequantize_gpt_oss_mxfp4(blocks, scales)
    assert out.dtype == F32 and out.shape == (2, 3, 64)  # [E, out, in], transposed back
    codes = unpack_fp4(blocks.reshape(2, 3, 64 // 2))  # 32 elements a block, low nibble first
    expected = E2M1[codes] * np.repeat(e8m0(scales), 32, axis=-1)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(out[0, 0, :2], [0.5, 1.0])  # byte 0x21
    np.testing.assert_array_equal(out[0, 1, :32], E2M1[codes[0, 1, :32]] * 2)  # b = 128: x2
    np.testing.assert_array_equal(out[0, 2, :32], E2M1[codes[0, 2, :32]] / 4)  # b = 125: x1/4

    # the loader's default dtype (bf16) gives the same values
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    bf16 = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales))
    assert bf16.dtype == torch.bfloat16 and bf16.shape == (2, 64, 3)
    np.testing.assert_array_equal(bf16.float().numpy().transpose(0, 2, 1), out)
