"""Checkpoints written and read by the peers' own code: the reference for jaxmx's safetensors I/O.

Each helper runs compressed-tensors (CT) or transformers on small CPU tensors and speaks numpy and
plain directories, so a test can set jaxmx's reader / writer against the peer on the same files.
The quantization math is always the peer's: these helpers only build the inputs the peer API needs
(a torch model, a config, a dict of tensors) and convert between numpy and torch.
See /work/shared/CHECKPOINT_FORMATS.md for the conventions these files follow.

Versions this was written against: compressed-tensors 0.20.1, transformers 5.24.0, torch 2.13 (CPU).

Arrays: numpy, float32 unless stated; low-precision tensors come back with their ml_dtypes dtype
(``float8_e4m3fn``, ``float8_e8m0fnu``, ``bfloat16``) or as ``uint8`` where the peer stores bytes.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors.torch
import torch
from compressed_tensors.compressors.model_compressors import ModelCompressor
from compressed_tensors.entrypoints.convert import convert_checkpoint
from compressed_tensors.entrypoints.convert.converters import (
    CompressedTensorsDequantizer,
    ModelOptNvfp4Converter,
)
from compressed_tensors.offload import update_offload_parameter
from compressed_tensors.quantization import (
    DynamicType,
    QuantizationArgs,
    QuantizationConfig,
    QuantizationStatus,
    QuantizationStrategy,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import (
    calculate_qparams,
    generate_gparam,
    maybe_pad_tensor_for_block_quant,
    strategy_cdiv,
)
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight, _get_ue8m0_dtype
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.modeling_utils import get_state_dict_dtype
from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig

__all__ = [
    "dequantize_compressed_tensors",
    "dequantize_fp8_transformers",
    "dequantize_gpt_oss_mxfp4",
    "load_with_transformers_fp8",
    "modelopt_to_compressed_tensors",
    "write_compressed_tensors",
    "write_fp8_transformers",
]

CT_SCHEMES = ("FP8", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4", "NVFP4A16", "MXFP4", "MXFP8")

# numpy (ml_dtypes) <-> torch for the dtypes numpy cannot hold natively: moved as raw bits.
_BITCAST = (
    (np.dtype(ml_dtypes.bfloat16), torch.bfloat16, np.int16, torch.int16),
    (np.dtype(ml_dtypes.float8_e4m3fn), torch.float8_e4m3fn, np.uint8, torch.uint8),
    (np.dtype(ml_dtypes.float8_e8m0fnu), torch.float8_e8m0fnu, np.uint8, torch.uint8),
)


def _to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    for np_dtype, torch_dtype, np_bits, _ in _BITCAST:
        if a.dtype == np_dtype:
            return torch.from_numpy(a.view(np_bits).copy()).view(torch_dtype)
    return torch.from_numpy(a.copy())


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """The tensor's bits as numpy (ml_dtypes for bf16 / fp8), no value conversion."""
    t = t.detach().cpu().contiguous()
    for np_dtype, torch_dtype, _, torch_bits in _BITCAST:
        if t.dtype == torch_dtype:
            return t.view(torch_bits).numpy().view(np_dtype)
    return t.numpy()


def _float32(t: torch.Tensor) -> np.ndarray:
    """Values as float32 numpy (exact for the bf16 / fp16 / fp8 / float32 the peers return)."""
    return t.detach().cpu().to(torch.float32).numpy()


def _load_dir(path) -> dict[str, torch.Tensor]:
    """Every tensor in every ``*.safetensors`` file of a directory (safetensors' torch loader)."""
    tensors = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(safetensors.torch.load_file(file))
    return tensors


def _read_config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def _set_submodule(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Puts ``module`` at the dotted path ``name``, creating plain parent modules on the way."""
    *parents, leaf = name.split(".")
    node = root
    for part in parents:
        if part not in node._modules:
            node.add_module(part, torch.nn.Module())
        node = node._modules[part]
    node.add_module(leaf, module)


# --------------------------------------------------------------------------- compressed-tensors


def _flatten_for_calibration(value: torch.Tensor, base_name: str, args: QuantizationArgs):
    """``(num_observations, *qparam_shape, group_size)`` view of a weight or activation.

    This is the observer's reshape of llm-compressor (``llmcompressor.observers.helpers.
    flatten_for_calibration``), the tool CT's calibrated checkpoints come from; it is not in CT and
    llm-compressor is not installed, so its few lines are mirrored here. It only groups values;
    every scale is computed by CT (``calculate_qparams``, ``generate_gparam``). One difference: a
    group strategy whose columns do not divide the group is zero-padded (zeros do not change a
    symmetric min/max) instead of failing in ``unflatten``, so that CT's compressor raises its own
    error for the shape (``_process_group``'s ``ValueError``).
    """
    strategy = args.strategy
    if base_name == "weight":
        if strategy == QuantizationStrategy.TENSOR:
            return value.reshape(1, 1, -1)
        if strategy == QuantizationStrategy.CHANNEL:
            return value.unsqueeze(-2).unsqueeze(0)
        if strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
            groups = strategy_cdiv(value.shape[-1], args.group_size, strategy)
            value = torch.nn.functional.pad(value, (0, groups * args.group_size - value.shape[-1]))
            return value.unflatten(-1, (groups, args.group_size)).unsqueeze(0)
        if strategy == QuantizationStrategy.BLOCK:
            bh, bw = args.block_structure
            value = maybe_pad_tensor_for_block_quant(value, args.block_structure)
            rows = strategy_cdiv(value.shape[0], bh, strategy, strict=True)
            cols = strategy_cdiv(value.shape[1], bw, strategy, strict=True)
            return value.reshape(rows, bh, cols, bw).transpose(1, 2).flatten(-2, -1).unsqueeze(0)
    else:  # activations [batch, seq, hidden]
        if strategy == QuantizationStrategy.TENSOR:
            return value.reshape(-1, 1, value.shape[-1])
        if strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
            groups = strategy_cdiv(value.shape[-1], args.group_size, strategy)
            value = torch.nn.functional.pad(value, (0, groups * args.group_size - value.shape[-1]))
            return value.flatten(0, 1).unflatten(-1, (groups, args.group_size))
    raise ValueError(f"no calibration for {base_name} with strategy {strategy}")


def _calibrate(module: torch.nn.Module, base_name: str, args: QuantizationArgs, value) -> None:
    """Sets ``<base>_scale`` / ``_zero_point`` / ``_global_scale`` of ``module`` from ``value``.

    The min-max observer (llm-compressor's ``MemorylessMinMaxObserver.get_qparams``): per-qparam
    min / max, the tensor-group global scale from their absmax (``generate_gparam``), then CT's
    ``calculate_qparams`` (which rounds NVFP4 scales to E4M3 and MX scales to powers of two).
    Locally dynamic args (NVFP4 activations) only get their global scale, as llm-compressor does.
    """
    flat = _flatten_for_calibration(value, base_name, args)
    min_vals = torch.amin(flat, dim=(0, -1))
    max_vals = torch.amax(flat, dim=(0, -1))
    global_scale = None
    if args.strategy == QuantizationStrategy.TENSOR_GROUP:
        absmax = torch.max(max_vals.max(), -min_vals.min()).reshape(1)
        global_scale = generate_gparam(-absmax, absmax)
        update_offload_parameter(module, f"{base_name}_global_scale", global_scale)
    if args.dynamic == DynamicType.LOCAL:
        return
    scale, zero_point = calculate_qparams(min_vals, max_vals, args, global_scale=global_scale)
    update_offload_parameter(module, f"{base_name}_scale", scale)
    if hasattr(module, f"{base_name}_zero_point"):
        update_offload_parameter(module, f"{base_name}_zero_point", zero_point)


def write_compressed_tensors(
    path,
    weights: dict[str, np.ndarray],
    scheme: str,
    extra: dict[str, np.ndarray] | None = None,
) -> None:
    """Writes a CT checkpoint of ``weights`` quantized with the CT preset ``scheme``.

    ``weights`` maps module names (``"model.layers.0.mlp.down_proj"``) to ``[out, in]`` arrays; a
    bias-free ``torch.nn.Linear`` is built at each dotted path, in the array's dtype (float32; pass
    ``ml_dtypes.bfloat16`` arrays for a bf16 model: CT's FP8 ``weight_scale`` has the model dtype).
    ``scheme`` is one of :data:`CT_SCHEMES` (CT's ``preset_name_to_scheme``, targets
    ``["Linear"]``).

    Steps, all CT API: ``apply_quantization_config`` (initializes the qparams); calibration of the
    weight qparams from the weights (:func:`_calibrate`, CT's ``calculate_qparams`` /
    ``generate_gparam``, no dataset), and of static input qparams (``FP8``'s ``input_scale``,
    ``NVFP4``'s ``input_global_scale``) from a seeded ``torch.randn`` batch of 8 tokens per module;
    ``ModelCompressor.from_pretrained_model(model).compress_model(model)``;
    ``safetensors.torch.save_file`` of the model's state dict to ``model.safetensors``; then
    ``ModelCompressor.update_config`` adds CT's ``quantization_config`` to a minimal
    ``config.json``.
    ``extra`` tensors (embeddings, norms; any dtype) are added to the file unquantized.

    Not llm-compressor: no global-scale fusion across q/k/v or gate/up (each NVFP4 module has its
    own ``weight_global_scale``). A shape CT cannot quantize raises CT's error (for example
    ``ValueError`` from ``_process_group`` when ``in`` is not a multiple of an FP4 group).
    """
    if scheme.upper() not in CT_SCHEMES:
        raise ValueError(f"scheme {scheme!r}: one of {CT_SCHEMES}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    model = torch.nn.Module()
    for name, w in weights.items():
        w = _to_torch(np.asarray(w))
        if w.ndim != 2:
            raise ValueError(f"{name}: a Linear weight is [out, in], got shape {tuple(w.shape)}")
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        with torch.no_grad():
            linear.weight.copy_(w)
        _set_submodule(model, name, linear)

    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])},
    )
    apply_quantization_config(model, config, show_progress=False)

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, module in model.named_modules():
            qscheme = getattr(module, "quantization_scheme", None)
            if qscheme is None:
                continue
            _calibrate(module, "weight", qscheme.weights, module.weight)
            inputs = qscheme.input_activations
            if inputs is not None and inputs.dynamic is not True:
                x = torch.randn(1, 8, module.in_features, generator=generator)
                _calibrate(module, "input", inputs, x.to(module.weight.dtype))
            module.quantization_status = QuantizationStatus.FROZEN

    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    for name, value in (extra or {}).items():
        state[name] = _to_torch(np.asarray(value))
    safetensors.torch.save_file(state, path / "model.safetensors")

    dtype = next(iter(weights.values())).dtype
    (path / "config.json").write_text(
        json.dumps({"model_type": "jaxmx_interop", "dtype": str(np.dtype(dtype))}, indent=2)
    )
    compressor.update_config(str(path))


def _decompress_compressed_tensors_native(path) -> dict[str, torch.Tensor]:
    """``{module.weight: tensor}`` as CT's decompressors return it (native dtype), see below."""
    tensors = _load_dir(path)
    quantized = sorted({k.rpartition(".")[0] for k in tensors if k.endswith(".weight_scale")})
    plain = sorted(
        {k.rpartition(".")[0] for k in tensors if k.endswith(".weight")} - set(quantized)
    )
    # dtype=None: the dequantizer's final `.to(dtype)` is a no-op, so CT's own output dtype shows
    dequantizer = CompressedTensorsDequantizer(str(path), ignore=plain, dtype=None)
    out = dequantizer.process(tensors)
    return {f"{m}.weight": out[f"{m}.weight"] for m in quantized}


def dequantize_compressed_tensors(path) -> dict[str, np.ndarray]:
    """CT's dequantization of every quantized weight of a CT directory, as float32.

    Returns ``{"<module>.weight": float32 [out, in]}`` for each module with a ``weight_scale``.
    Decompression is CT's model-free entry point
    (``compressed_tensors.entrypoints.convert.converters.CompressedTensorsDequantizer.process``),
    which reads ``config.json``'s ``quantization_config``, picks the compressor of each config
    group (``BaseCompressor.get_value_from_registry(format)``) and calls its ``decompress``, the
    same classmethod transformers' ``CompressedTensorsHfQuantizer`` reaches through
    ``ModelCompressor.decompress_model``. (CT 0.20.1 has no ``ModelCompressor.from_pretrained``.)
    Modules with a ``.weight`` but no ``weight_scale`` (embeddings, written with ``extra``) are
    passed as ``ignore``: model-free, CT's target ``"Linear"`` matches every ``.weight``.

    dtype CT produces (converted here to float32, losslessly):
    - ``float-quantized`` (FP8, FP8_DYNAMIC, FP8_BLOCK): the ``weight_scale`` dtype, i.e. the model
      dtype (float32 for a float32 model, bf16 for a bf16 one);
    - ``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``: bf16 (``unpack_fp4_from_uint8``'s
      default). NVFP4 computes ``bf16(e2m1 * fl32(bf16(weight_scale) / weight_global_scale))``
      for CT's ``[1]``-shaped global scale; a 0-d one (``modelopt_to_compressed_tensors``) keeps
      the division in bf16 (torch's promotion), so there it is
      ``bf16(e2m1 * bf16(weight_scale / weight_global_scale))``;
    - ``mxfp8-quantized``: bf16 (``decompress_mx_scale`` returns bf16 scales).
    """
    return {k: _float32(v) for k, v in _decompress_compressed_tensors_native(path).items()}


def modelopt_to_compressed_tensors(src, dst) -> None:
    """Converts a ModelOpt NVFP4 directory to CT's ``nvfp4-pack-quantized`` with CT's converter.

    Runs ``compressed_tensors.entrypoints.convert.convert_checkpoint(src, dst,
    ModelOptNvfp4Converter(ignore, targets=["Linear"]), device="cpu")``: ``weight`` (uint8) becomes
    ``weight_packed`` (bytes unchanged), ``weight_scale`` (E4M3) is kept, ``weight_scale_2`` becomes
    ``weight_global_scale = 1 / weight_scale_2`` (float32 division, 0-d) and ``input_scale``
    becomes ``input_global_scale = 1 / input_scale``; CT writes the ``quantization_config``
    (``NVFP4`` preset) into the copied ``config.json`` and a ``model.safetensors.index.json``.
    CT does not read ``hf_quant_config.json``; ``ignore`` is every module whose ``weight`` is not
    uint8 (embeddings, lm_head), which is what its ``exclude_modules`` lists in a ModelOpt export.
    ``dequantize_compressed_tensors(dst)`` is then the peer's dequantization of the ModelOpt file:
    because the global scale is 0-d, CT gives ``bf16(e2m1 * bf16(weight_scale / fl32(1 / ws2)))``
    (two bf16 roundings), within about a bf16 ulp of ModelOpt's ``e2m1 * weight_scale * ws2`` but
    not always equal to its bf16 rounding.
    """
    tensors = _load_dir(src)
    ignore = sorted(
        k.rpartition(".")[0]
        for k, v in tensors.items()
        if k.endswith(".weight") and v.dtype != torch.uint8
    )
    converter = ModelOptNvfp4Converter(ignore=ignore, targets=["Linear"])
    Path(dst).mkdir(parents=True, exist_ok=True)
    convert_checkpoint(str(src), str(dst), converter, max_workers=1, device="cpu")


# --------------------------------------------------------------------------- transformers


def _fp8_quantizer(quantization_config: dict):
    """transformers' config class and quantizer for a ``quantization_config`` dict (``fp8`` or
    ``mxfp8``): ``AutoQuantizationConfig.from_dict`` and ``AutoHfQuantizer.from_config``."""
    config = AutoQuantizationConfig.from_dict(dict(quantization_config))
    return config, AutoHfQuantizer.from_config(config, pre_quantized=True)


def write_fp8_transformers(
    path,
    weights: dict[str, np.ndarray],
    *,
    block_size=(128, 128),
    scale_fmt: str = "float",
) -> None:
    """Writes a transformers fine-grained FP8 checkpoint; each weight is quantized by transformers.

    ``config.json`` holds ``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
    list(block_size) or None, "activation_scheme": "dynamic"}`` (DeepSeek-V3's dict), plus
    ``"scale_fmt": "ue8m0"`` when asked. Each ``<module>.weight`` goes through the quantizer's save
    op, ``FineGrainedFP8HfQuantizer.get_quantize_ops()`` = ``transformers.integrations.
    finegrained_fp8.Fp8Quantize`` (``_quantize_one``), which gives ``<module>.weight``
    (float8_e4m3fn) and ``<module>.weight_scale_inv``: float32 ``amax/448`` per block, or, with
    ``scale_fmt="ue8m0"`` (supported by ``Fp8Quantize`` itself), ``float8_e8m0fnu`` powers of two
    ``2^ceil(log2(amax/448))``. As transformers does:

    - a weight whose shape does not divide the block is left unquantized (written as given, no
      scale): ``Fp8Quantize`` passes it through;
    - ``block_size=None`` (per tensor) uses the whole weight as one block, so the scale is
      ``[1, 1]``, not the 0-d scale ``FP8Linear`` allocates.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    quantization_config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": list(block_size) if block_size is not None else None,
        "activation_scheme": "dynamic",
    }
    if scale_fmt == "ue8m0":
        quantization_config["scale_fmt"] = "ue8m0"
    elif scale_fmt != "float":
        raise ValueError(f"scale_fmt {scale_fmt!r}: 'float' or 'ue8m0'")
    _, quantizer = _fp8_quantizer(quantization_config)
    quantize = quantizer.get_quantize_ops()

    state = {}
    for name, w in weights.items():
        state.update(quantize.convert({f"{name}.weight": _to_torch(np.asarray(w))}))
    state = {k: v.contiguous() for k, v in state.items()}
    safetensors.torch.save_file(state, path / "model.safetensors")
    dtype = next(iter(weights.values())).dtype
    config = {
        "model_type": "jaxmx_interop",
        "dtype": str(np.dtype(dtype)),
        "quantization_config": quantization_config,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))


def dequantize_fp8_transformers(path) -> dict[str, np.ndarray]:
    """transformers' dequantization of each ``<module>.weight`` of an FP8 directory, as float32.

    Uses ``transformers.integrations.finegrained_fp8._dequantize_fp8_weight(weight, scale,
    block_size, torch.float32)`` with the **config's** ``weight_block_size``: it repeats the scales
    by the block and crops, so the ceil grid ``FP8Linear`` allocates for shapes that do not divide
    the block is read right. (``Fp8Dequantize``, the loader's op, infers the block from the grid
    instead; see :func:`load_with_transformers_fp8`.) With ``scale_fmt: "ue8m0"``, uint8 scales are
    first viewed as ``float8_e8m0fnu``, as ``FineGrainedFP8HfQuantizer.
    _process_model_after_weight_loading`` does. A ``.weight`` without a ``weight_scale_inv`` (left
    unquantized) is returned as stored, cast to float32.
    """
    quantization_config = _read_config(path)["quantization_config"]
    block_size = quantization_config.get("weight_block_size")
    ue8m0 = quantization_config.get("scale_fmt") == "ue8m0"
    tensors = _load_dir(path)
    out = {}
    for name, weight in tensors.items():
        if not name.endswith(".weight"):
            continue
        scale = tensors.get(f"{name}_scale_inv")
        if scale is None:
            out[name] = _float32(weight)
            continue
        if ue8m0 and scale.dtype == torch.uint8:
            scale = scale.view(_get_ue8m0_dtype())
        out[name] = _float32(_dequantize_fp8_weight(weight, scale, block_size, torch.float32))
    return out


def load_with_transformers_fp8(path) -> dict[str, np.ndarray]:
    """The ``<module>.weight`` values transformers' loader gives for an FP8 directory, as float32.

    ``from_pretrained`` itself needs a real architecture (``model_type``) and accelerate, so this
    runs the loader's own pieces on the checkpoint's tensors, as a CPU ``from_pretrained`` does:
    the quantizer (``AutoHfQuantizer.from_config``) with ``dequantize=True`` (what
    ``FineGrainedFP8HfQuantizer.validate_environment`` sets without a GPU), its
    ``update_weight_conversions`` (the ``.scale`` / ``.qscale_weight`` -> ``.weight_scale_inv``
    renames and the ``WeightConverter(["weight", "weight_scale_inv", "activation_scale"],
    "weight", [Fp8Dequantize])``), ``core_model_loading.rename_source_key`` to group the tensors,
    and ``Fp8Dequantize.convert`` on each group, with a stand-in model whose ``.weight`` params
    have the loader's dtype (``dtype="auto"``: config.json's ``dtype`` / ``torch_dtype``, else
    ``get_state_dict_dtype``), which ``Fp8Dequantize`` casts to.

    ``Fp8Dequantize`` infers the block from the scale grid (``rows / scale_rows``), not the config:
    a ceil grid (a shape that does not divide the block) is misread, or raises ``ValueError``
    (``[129, 256]`` with a ``[2, 2]`` grid). That is transformers' behaviour, kept here on purpose.
    """
    raw_config = _read_config(path)
    config, quantizer = _fp8_quantizer(raw_config["quantization_config"])
    config.dequantize = True
    tensors = _load_dir(path)

    dtype_name = raw_config.get("dtype") or raw_config.get("torch_dtype")
    dtype = getattr(torch, dtype_name) if dtype_name else get_state_dict_dtype(tensors)

    stand_in = torch.nn.Module()
    stand_in.config = types.SimpleNamespace(model_type=raw_config.get("model_type", ""))
    conversions = quantizer.update_weight_conversions([], stand_in)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    groups: dict[str, dict[str, list[torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        target, pattern = rename_source_key(key, renamings, converters)
        if pattern is not None and target.endswith(".weight"):
            groups.setdefault(target, {})[pattern] = [tensor]

    for target in groups:
        module = torch.nn.Module()
        module.register_parameter(
            "weight", torch.nn.Parameter(torch.empty(0, dtype=dtype, device="meta"), False)
        )
        _set_submodule(stand_in, target.removesuffix(".weight"), module)

    (converter,) = converters
    out = {}
    for target, collected in groups.items():
        if "weight" not in collected:
            continue  # a scale without its weight: the loader reports it as unexpected
        for op in converter.operations:
            collected = op.convert(
                collected,
                source_patterns=converter.source_patterns,
                target_patterns=converter.target_patterns,
                full_layer_name=target,
                model=stand_in,
            )
        (value,) = collected.values()
        out[target] = _float32(value[0] if isinstance(value, list) else value)
    return out


def dequantize_gpt_oss_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' gpt-oss MXFP4 dequantization, as float32 ``[E, out, in]``.

    ``blocks``: uint8 ``[E, out, G, 16]``, ``scales``: uint8 ``[E, out, G]`` (E8M0 bytes), with
    ``in = 32 G``. Calls ``transformers.integrations.mxfp4.convert_moe_packed_tensors(blocks,
    scales, dtype=torch.float32)``, which returns ``[E, in, out]`` (transposed for gpt-oss's
    ``x @ W``); it is transposed back here to the checkpoint's ``[E, out, in]``. The loader passes
    the model dtype (bf16 by default) instead of float32: the LUT values times ``2^(b-127)`` are the
    same in bf16 wherever they are finite.
    """
    out = convert_moe_packed_tensors(
        torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.uint8)),
        torch.from_numpy(np.ascontiguousarray(scales, dtype=np.uint8)),
        dtype=torch.float32,
    )
    return _float32(out.transpose(1, 2))
