"""What a checkpoint's quantized weights are: a :class:`Scheme` (the convention of one peer, its
weight layout, its block and scale dtype), read from and written to the peers' metadata
(``config.json``'s ``quantization_config``, ModelOpt's ``hf_quant_config.json``).

Example:
    >>> s = scheme_of({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
    ...                "activation_scheme": "dynamic"}, None)
    >>> s.method, s.weights, s.block_size, s.scale_dtype
    ('fp8', 'block', (128, 128), 'float32')
    >>> qc = quantization_config(Scheme(method="fp8", weights="block"), ignore=["lm_head"])
    >>> qc["weight_block_size"], qc["modules_to_not_convert"]
    ([128, 128], ['lm_head'])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxmx._src.checkpoints.safetensors_files import CheckpointError

METHODS = ("fp8", "mxfp8", "mxfp4", "compressed-tensors", "modelopt")
"""The conventions jaxmx reads and writes (``Scheme.method``):

- ``"fp8"``: transformers' fine-grained FP8 (DeepSeek-V3, Qwen3-FP8, Kimi), block or per tensor;
- ``"mxfp8"``: transformers' MXFP8 (the fine-grained FP8 path with ``[1, 32]`` E8M0 blocks);
- ``"mxfp4"``: transformers' MXFP4 (gpt-oss experts: ``*_blocks`` and ``*_scales``);
- ``"compressed-tensors"``: vLLM / llm-compressor's format (``float-quantized`` FP8,
  ``mxfp8-quantized``, ``mxfp4-pack-quantized``, ``nvfp4-pack-quantized``);
- ``"modelopt"``: NVIDIA ModelOpt's NVFP4 export (``hf_quant_config.json``).
"""

LAYOUTS = {
    "fp8": ("block", "tensor"),
    "mxfp8": ("mxfp8",),
    "mxfp4": ("mxfp4",),
    "compressed-tensors": ("tensor", "channel", "block", "mxfp8", "mxfp4", "nvfp4"),
    "modelopt": ("nvfp4",),
}
"""The weight layouts of each method (``Scheme.weights``): FP8 E4M3 with float scales per
``"tensor"``, per output ``"channel"`` or per ``"block"`` tile; ``"mxfp8"`` / ``"mxfp4"``: E8M0
scales per 32 along ``in``; ``"nvfp4"``: E4M3 scales per 16 along ``in`` and a float32 tensor
scale."""

SCALE_DTYPES = {
    ("fp8", "block"): ("float32", "ue8m0"),
    ("fp8", "tensor"): ("float32",),
    ("compressed-tensors", "tensor"): ("bfloat16", "float16", "float32"),
    ("compressed-tensors", "channel"): ("bfloat16", "float16", "float32"),
    ("compressed-tensors", "block"): ("bfloat16", "float16", "float32"),
}
"""The scale dtypes a layout may store (``Scheme.scale_dtype``); the first is the default. The
others have one: E8M0 bytes (``"ue8m0"``) for the MX layouts, E4M3 for NVFP4."""

_FIXED_SCALE_DTYPE = {"mxfp8": "ue8m0", "mxfp4": "ue8m0", "nvfp4": "float8_e4m3fn"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scheme:
    """How a checkpoint stores its quantized weights.

    Example:
        >>> Scheme(method="compressed-tensors", weights="nvfp4").scale_dtype
        'float8_e4m3fn'
        >>> Scheme(method="fp8", weights="channel")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        jaxmx...CheckpointError: Scheme: method 'fp8' stores weights as one of ('block', ...
    """

    # the peer convention, one of METHODS
    method: str
    # the weight layout, one of LAYOUTS[method]
    weights: str
    # block layouts: the (rows, cols) of [out, in] one scale covers; None elsewhere
    block_size: tuple[int, int] | None = None
    # how the scales are stored (SCALE_DTYPES); None: the layout's default
    scale_dtype: str | None = None
    # "tensor" layouts: the shape of the one scale, () or (1,) or (1, 1); None: the method's
    # default (transformers: (), as its FP8Linear allocates it; compressed-tensors: (1,))
    scale_shape: tuple[int, ...] | None = None
    # the quantization_config as read (written back as it was); None: jaxmx writes its own
    config: Mapping | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.method not in METHODS:
            raise CheckpointError(f"Scheme: unknown method {self.method!r}; jaxmx knows {METHODS}")
        if self.weights not in LAYOUTS[self.method]:
            raise CheckpointError(
                f"Scheme: method {self.method!r} stores weights as one of "
                f"{LAYOUTS[self.method]}, not {self.weights!r}"
            )
        if self.weights == "block":
            size = self.block_size
            if size is None:
                object.__setattr__(self, "block_size", size := (128, 128))
            if len(size) != 2 or not all(isinstance(b, int) and b > 0 for b in size):
                raise CheckpointError(f"Scheme: block_size must be two positive ints, got {size}")
            object.__setattr__(self, "block_size", tuple(size))
        elif self.block_size is not None:
            raise CheckpointError(f"Scheme: {self.weights!r} weights take no block_size")
        if self.weights == "tensor":
            default = () if self.method == "fp8" else (1,)
            shape = default if self.scale_shape is None else tuple(self.scale_shape)
            if shape not in ((), (1,), (1, 1)):
                raise CheckpointError(
                    f"Scheme: scale_shape must be (), (1,) or (1, 1), got {shape}"
                )
            object.__setattr__(self, "scale_shape", shape)
        elif self.scale_shape is not None:
            raise CheckpointError(f"Scheme: {self.weights!r} weights take no scale_shape")
        allowed = SCALE_DTYPES.get(
            (self.method, self.weights), (_FIXED_SCALE_DTYPE.get(self.weights),)
        )
        if self.scale_dtype is None:
            object.__setattr__(self, "scale_dtype", allowed[0])
        elif self.scale_dtype not in allowed:
            raise CheckpointError(
                f"Scheme: {self.method} {self.weights} scales are stored as one of {allowed}, "
                f"not {self.scale_dtype!r}"
            )


def scheme_of(qc: Mapping | None, hf_quant: Mapping | None) -> Scheme | None:
    """The :class:`Scheme` that ``config.json``'s ``quantization_config`` (``qc``) and
    ``hf_quant_config.json`` (``hf_quant``) declare; ``None`` for an unquantized checkpoint.
    Anything jaxmx would misread raises a :class:`CheckpointError` naming the key."""
    if hf_quant is not None and (qc is None or qc.get("quant_method") == "modelopt"):
        return _modelopt(hf_quant.get("quantization", hf_quant), qc)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "modelopt":
        return _modelopt(qc.get("quantization", qc), qc)
    if method == "fp8":
        return _fp8(qc)
    if method == "mxfp8":
        if list(qc.get("weight_block_size") or []) != [1, 32] or qc.get("scale_fmt") != "ue8m0":
            raise CheckpointError(
                "quantization_config: mxfp8 needs weight_block_size [1, 32] and scale_fmt "
                f"'ue8m0', got {qc.get('weight_block_size')} and {qc.get('scale_fmt')!r}"
            )
        return Scheme(method="mxfp8", weights="mxfp8", config=qc)
    if method == "mxfp4":
        return Scheme(method="mxfp4", weights="mxfp4", config=qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise CheckpointError(
        f"quantization_config: quant_method {method!r} is not one jaxmx reads ({METHODS})"
    )


def _fp8(qc: Mapping) -> Scheme:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"quantization_config: fp8 fmt {qc.get('fmt')!r}, jaxmx reads 'e4m3'")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise CheckpointError(
            f"quantization_config: expert_dtype {qc.get('expert_dtype')!r} (FP4-packed experts) "
            "is not read by jaxmx"
        )
    scale = {"float": "float32", None: "float32", "ue8m0": "ue8m0"}.get(qc.get("scale_fmt"))
    if scale is None:
        raise CheckpointError(f"quantization_config: unknown scale_fmt {qc.get('scale_fmt')!r}")
    block = qc.get("weight_block_size")
    if block is None:
        return Scheme(method="fp8", weights="tensor", scale_dtype=scale, config=qc)
    if not isinstance(block, (list, tuple)) or len(block) != 2:
        raise CheckpointError(
            f"quantization_config: weight_block_size {block!r} is not [rows, cols]"
        )
    return Scheme(
        method="fp8", weights="block", block_size=tuple(block), scale_dtype=scale, config=qc
    )


def _modelopt(q: Mapping, qc: Mapping | None) -> Scheme:
    algo, group = q.get("quant_algo"), q.get("group_size", 16)
    if algo != "NVFP4" or group != 16:
        raise CheckpointError(
            f"hf_quant_config: quant_algo {algo!r} with group_size {group!r}; jaxmx reads "
            "ModelOpt's NVFP4 (group_size 16)"
        )
    return Scheme(method="modelopt", weights="nvfp4", config=qc)


_CT_FORMATS = {
    "float-quantized": ("tensor", "channel", "block"),
    "naive-quantized": ("tensor", "channel", "block"),
    "mxfp8-quantized": ("mxfp8",),
    "mxfp4-pack-quantized": ("mxfp4",),
    "nvfp4-pack-quantized": ("nvfp4",),
}


def _compressed_tensors(qc: Mapping) -> Scheme:
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise CheckpointError(
            f"quantization_config: compressed-tensors quantization_status {status!r}; jaxmx "
            "reads 'compressed' checkpoints (the others hold no codes)"
        )
    groups = qc.get("config_groups") or {}
    found = set()
    for name, group in groups.items():
        w = group.get("weights")
        if w is None:
            raise CheckpointError(f"quantization_config: config group {name!r} has no weights")
        fmt = group.get("format") or qc.get("format")
        found.add((_ct_layout(name, w, fmt), _ct_block(w), _ct_scale_dtype(w)))
    if len(found) != 1:
        raise CheckpointError(
            "quantization_config: compressed-tensors with "
            f"{'no' if not found else 'differing'} weight schemes across config groups "
            f"({sorted(groups)}); jaxmx reads one weight scheme per checkpoint"
        )
    ((layout, block, scale),) = found
    return Scheme(
        method="compressed-tensors", weights=layout, block_size=block, scale_dtype=scale, config=qc
    )


def _ct_layout(group: str, w: Mapping, fmt: str | None) -> str:
    where = f"quantization_config: config group {group!r}"
    if w.get("type") != "float":
        raise CheckpointError(
            f"{where}: {w.get('type')!r} weights are not read by jaxmx (float only)"
        )
    if not w.get("symmetric", True):
        raise CheckpointError(f"{where}: asymmetric weights (zero points) are not read by jaxmx")
    strategy, bits, group_size = w.get("strategy"), w.get("num_bits"), w.get("group_size")
    if bits == 8 and strategy in ("tensor", "channel", "block"):
        layout = strategy
    elif bits == 8 and strategy == "group" and group_size == 32:
        layout = "mxfp8"
    elif bits == 4 and strategy == "group" and group_size == 32:
        layout = "mxfp4"
    elif bits == 4 and strategy == "tensor_group" and group_size == 16:
        layout = "nvfp4"
    else:
        raise CheckpointError(
            f"{where}: {bits}-bit float weights with strategy {strategy!r} and group_size "
            f"{group_size!r} are not a layout jaxmx reads"
        )
    if fmt is not None and layout not in _CT_FORMATS.get(fmt, ()):
        raise CheckpointError(f"{where}: format {fmt!r} does not store {layout!r} weights")
    return layout


def _ct_block(w: Mapping) -> tuple[int, int] | None:
    if w.get("strategy") != "block":
        return None
    block = w.get("block_structure")
    if not isinstance(block, (list, tuple)) or len(block) != 2:
        raise CheckpointError(f"quantization_config: block_structure {block!r} is not [rows, cols]")
    return tuple(block)


def _ct_scale_dtype(w: Mapping) -> str | None:
    dtype = w.get("scale_dtype")
    if w.get("num_bits") == 4 or w.get("strategy") == "group":
        return None  # fixed by the layout (E8M0 bytes, E4M3)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def quantization_config(scheme: Scheme, *, ignore: list[str]) -> dict:
    """The ``quantization_config`` a peer's reader expects for ``scheme`` (``scheme.config``
    as it was read, when there is one), with the unquantized Linear modules ``ignore``."""
    if scheme.config is not None:
        return dict(scheme.config)
    if scheme.method == "fp8":
        qc = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": None if scheme.block_size is None else list(scheme.block_size),
        }
        if scheme.scale_dtype == "ue8m0":
            qc["scale_fmt"] = "ue8m0"
        return {**qc, "modules_to_not_convert": ignore}
    if scheme.method == "mxfp8":
        return {
            "quant_method": "mxfp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [1, 32],
            "scale_fmt": "ue8m0",
            "modules_to_not_convert": ignore,
        }
    if scheme.method == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": ignore}
    if scheme.method == "modelopt":
        return {
            "quant_method": "modelopt",
            **modelopt_config(scheme, ignore=ignore)["quantization"],
        }
    return _ct_config(scheme, ignore)


def modelopt_config(scheme: Scheme, *, ignore: list[str]) -> dict:
    """ModelOpt's ``hf_quant_config.json`` for an NVFP4 ``scheme``."""
    return {
        "producer": {"name": "modelopt", "version": "jaxmx"},
        "quantization": {
            "quant_algo": "NVFP4",
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "exclude_modules": ignore,
        },
    }


def _ct_config(scheme: Scheme, ignore: list[str]) -> dict:
    fmt = {
        "tensor": "float-quantized",
        "channel": "float-quantized",
        "block": "float-quantized",
        "mxfp8": "mxfp8-quantized",
        "mxfp4": "mxfp4-pack-quantized",
        "nvfp4": "nvfp4-pack-quantized",
    }[scheme.weights]
    weights = {
        "num_bits": 4 if scheme.weights in ("mxfp4", "nvfp4") else 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "observer": "minmax",
        "strategy": {"mxfp8": "group", "mxfp4": "group", "nvfp4": "tensor_group"}.get(
            scheme.weights, scheme.weights
        ),
        "group_size": {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}.get(scheme.weights),
        "block_structure": None if scheme.block_size is None else list(scheme.block_size),
    }
    if scheme.weights in ("mxfp8", "mxfp4"):
        weights["scale_dtype"] = "torch.uint8"
    elif scheme.weights == "nvfp4":
        weights["scale_dtype"] = "torch.float8_e4m3fn"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
    }
