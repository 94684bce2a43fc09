"""The entries of a checkpoint's tree: which stored tensors each is read from (a quantized
weight's codes, scales and tensor scale, found by the names its scheme gives them), checked to
be complete, and what the stored scales say about the scheme that its config leaves out.

Example:
    >>> from jaxmx._src.checkpoints.scheme import Scheme
    >>> r = roles(Scheme(method="fp8", weights="block"))
    >>> r.codes, r.scale, r.key
    ('.weight', '.weight_scale_inv', '.weight')
    >>> roles(Scheme(method="mxfp4", weights="mxfp4")).scale
    '_scales'
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxmx._src.checkpoints.safetensors_files import CheckpointError, ShardedReader
from jaxmx._src.checkpoints.scheme import Scheme


@dataclasses.dataclass(frozen=True, kw_only=True)
class Roles:
    """The names of a quantized weight's tensors: ``<module><suffix>`` for its codes, scales and
    (NVFP4) tensor scale, and the suffix of its MXArray's name."""

    codes: str
    scale: str
    tensor_scale: str | None
    key: str


def roles(scheme: Scheme) -> Roles:
    """The :class:`Roles` of the quantized weights of ``scheme``."""
    if scheme.method in ("fp8", "mxfp8"):
        return Roles(codes=".weight", scale=".weight_scale_inv", tensor_scale=None, key=".weight")
    if scheme.method == "mxfp4":
        return Roles(codes="_blocks", scale="_scales", tensor_scale=None, key="")
    if scheme.method == "modelopt":
        return Roles(
            codes=".weight", scale=".weight_scale", tensor_scale=".weight_scale_2", key=".weight"
        )
    if scheme.weights in ("mxfp4", "nvfp4"):
        nvfp4 = scheme.weights == "nvfp4"
        return Roles(
            codes=".weight_packed",
            scale=".weight_scale",
            tensor_scale=".weight_global_scale" if nvfp4 else None,
            key=".weight",
        )
    return Roles(codes=".weight", scale=".weight_scale", tensor_scale=None, key=".weight")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
    """One tree entry: the tensor names it is read from (codes first) and whether it is a
    quantized weight."""

    key: str
    names: tuple[str, ...]
    quantized: bool


def entries(reader: ShardedReader, scheme: Scheme | None) -> list[Entry]:
    """The tree's entries, in the index's order, each quantized weight's tensors checked to be
    complete; every tensor belongs to exactly one entry."""
    names = reader.names()
    present = set(names)
    used: set[str] = set()
    quantized: dict[str, Entry] = {}
    if scheme is not None:
        r = roles(scheme)
        for name in names:
            if not name.endswith(r.scale):
                continue
            module = name[: -len(r.scale)]
            codes = module + r.codes
            if codes not in present:
                raise CheckpointError(f"scale tensor {name!r} has no weight {codes!r}")
            group = (codes, name)
            if r.tensor_scale is not None:
                tensor_scale = module + r.tensor_scale
                if tensor_scale not in present:
                    raise CheckpointError(
                        f"weight {codes!r}: its tensor scale {tensor_scale!r} is missing"
                    )
                group += (tensor_scale,)
            quantized[codes] = Entry(key=module + r.key, names=group, quantized=True)
            used.update(group)
    found = []
    for name in names:
        if name in quantized:
            found.append(quantized[name])
        elif name not in used:
            _refuse_unscaled(reader, scheme, name)
            found.append(Entry(key=name, names=(name,), quantized=False))
    return found


def _refuse_unscaled(reader: ShardedReader, scheme: Scheme | None, name: str) -> None:
    """A tensor that only a scale makes sense of, found without one, raises."""
    dtype, _ = reader.info(name)
    if (dtype.itemsize == 1 and dtype.kind in "fV") or (
        dtype == np.uint8 and name.endswith((".weight", "_blocks", ".weight_packed"))
    ):
        if scheme is None:
            raise CheckpointError(
                f"tensor {name!r} is {dtype.name}, but config.json declares no "
                "quantization_config: its scales are unknown"
            )
        raise CheckpointError(
            f"tensor {name!r} is {dtype.name} but its scale {_expected_scale(scheme, name)!r} is "
            "missing"
        )
    if (
        scheme is not None
        and scheme.weights == "nvfp4"
        and name.endswith((".weight_scale_2", ".weight_global_scale"))
    ):
        raise CheckpointError(f"tensor scale {name!r} has no block scales beside it")


def _expected_scale(scheme: Scheme, name: str) -> str:
    r = roles(scheme)
    module = name.removesuffix(r.codes) if name.endswith(r.codes) else name
    return module + r.scale


def with_stored_scales(
    scheme: Scheme | None, reader: ShardedReader, found: list[Entry]
) -> Scheme | None:
    """The scheme with what the config does not state but the scales show, which every weight
    must share: compressed-tensors' FP8 scale dtype (the model's) and the shape of a per-tensor
    scale (``()`` where transformers' FP8Linear allocates it, ``[1, 1]`` where its saver
    writes it, ``[1]`` in compressed-tensors)."""
    if scheme is None or scheme.weights not in ("tensor", "channel", "block"):
        return scheme
    dtypes, shapes = {}, {}
    for entry in found:
        if entry.quantized:
            dtype, shape = reader.info(entry.names[1])
            dtypes.setdefault(dtype.name, entry.names[1])
            shapes.setdefault(shape, entry.names[1])
    if scheme.method == "compressed-tensors" and dtypes:
        if len(dtypes) > 1:
            raise CheckpointError(f"scales of differing dtypes: {dtypes}; jaxmx reads one")
        ((dtype, name),) = dtypes.items()
        if dtype not in ("float32", "bfloat16", "float16"):
            raise CheckpointError(f"{name}: float scales expected, got {dtype}")
        scheme = dataclasses.replace(scheme, scale_dtype=dtype)
    if scheme.weights == "tensor" and shapes:
        if len(shapes) > 1:
            raise CheckpointError(f"per-tensor scales of differing shapes: {shapes}")
        ((shape, name),) = shapes.items()
        if math.prod(shape) != 1 or len(shape) > 2:
            raise CheckpointError(f"{name}: a per-tensor scale, got shape {list(shape)}")
        scheme = dataclasses.replace(scheme, scale_shape=shape)
    return scheme
