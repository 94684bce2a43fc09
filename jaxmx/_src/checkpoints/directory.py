"""Load and save a Hugging Face style checkpoint directory: ``config.json`` (with its
``quantization_config``), ``hf_quant_config.json`` where ModelOpt wrote one, and one or several
safetensors shards (with their index), as a flat ``{name: MXArray | jax.Array}`` tree.

Example:
    >>> import tempfile, jax.numpy as jnp, jaxmx
    >>> from jaxmx._src.checkpoints.scheme import Scheme
    >>> w = jaxmx.quantize(jnp.ones((4, 64)), "mxfp8_e4m3")
    >>> d = tempfile.mkdtemp()
    >>> save(d, {"proj.weight": w, "norm.weight": jnp.ones(4)},
    ...      Scheme(method="compressed-tensors", weights="mxfp8"))
    >>> ckpt = load(d)
    >>> ckpt.scheme.weights, ckpt.tensors["proj.weight"].fmt, sorted(ckpt.tensors)
    ('mxfp8', 'mxfp8_e4m3', ['norm.weight', 'proj.weight'])
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import sys
from collections.abc import Callable, Iterator, Mapping

import jax
import numpy as np

from jaxmx._src.checkpoints import layouts
from jaxmx._src.checkpoints.safetensors_files import (
    CheckpointError,
    ShardedReader,
    read_json,
    write_shards,
)
from jaxmx._src.checkpoints.scheme import (
    Scheme,
    modelopt_config,
    quantization_config,
    scheme_of,
)
from jaxmx._src.core.mxarray import MXArray

CONFIG = "config.json"
MODELOPT_CONFIG = "hf_quant_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

Tensor = MXArray | jax.Array
Sharding = jax.sharding.Sharding | Callable[[str, Tensor], jax.sharding.Sharding | None] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """What :func:`load` read.

    Attributes:
        tensors: ``{name: MXArray | jax.Array}``: each quantized weight as one MXArray under its
            weight's name (``"...q_proj.weight"``; gpt-oss experts under ``"...gate_up_proj"``),
            every other tensor (biases, norms, embeddings, activation scales) as it is stored
            (and a compressed-tensors NVFP4 encode factor loaded inexactly, see :func:`load`).
        scheme: the :class:`Scheme` of the quantized weights; ``None`` for an unquantized
            checkpoint.
        config: ``config.json`` as read (``{}`` when absent), for writing the model back.
    """

    tensors: dict[str, Tensor]
    scheme: Scheme | None
    config: dict


@dataclasses.dataclass(frozen=True)
class _Roles:
    """The names of a quantized weight's tensors: ``<module><suffix>`` for its codes, scales and
    (NVFP4) tensor scale, and the suffix of its MXArray's name."""

    codes: str
    scale: str
    tensor_scale: str | None
    key: str


def _roles(scheme: Scheme) -> _Roles:
    if scheme.method in ("fp8", "mxfp8"):
        return _Roles(".weight", ".weight_scale_inv", None, ".weight")
    if scheme.method == "mxfp4":
        return _Roles("_blocks", "_scales", None, "")
    if scheme.method == "modelopt":
        return _Roles(".weight", ".weight_scale", ".weight_scale_2", ".weight")
    if scheme.weights in ("mxfp4", "nvfp4"):
        nvfp4 = scheme.weights == "nvfp4"
        return _Roles(
            ".weight_packed", ".weight_scale", ".weight_global_scale" if nvfp4 else None, ".weight"
        )
    return _Roles(".weight", ".weight_scale", None, ".weight")


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One tree entry: the tensor names it is read from (codes first) and whether it is a
    quantized weight."""

    key: str
    names: tuple[str, ...]
    quantized: bool


def load(
    path: str | os.PathLike,
    *,
    sharding: Sharding = None,
    progress: bool | Callable[[str], None] = False,
    inexact_tensor_scales: str = "raise",
) -> Checkpoint:
    """Reads the checkpoint directory ``path`` into MXArrays and arrays, shard by shard, with
    no decode (codes and scales are copied; FP4 bytes unpacked to one code per byte).

    Args:
        path: a directory with ``model.safetensors`` or ``model.safetensors.index.json`` and
            its shards, and ``config.json`` (``hf_quant_config.json`` for ModelOpt).
        sharding: where the arrays go: ``None`` (the default device), one
            ``jax.sharding.Sharding`` for every array, or a function ``(name, value) ->
            Sharding | None`` (``value``: the MXArray or array, numpy-backed). An MXArray's codes
            and scales take the same sharding (its NVFP4 tensor scale is replicated). Each
            device receives only its shard's slice, so a sharded model never sits whole on one
            device.
        progress: ``True`` prints a line per shard to stderr; a function receives the lines.
        inexact_tensor_scales: compressed-tensors stores NVFP4's tensor scale as an encode
            factor, jaxmx holds its float32 reciprocal; about one in eight float32 values has
            none that converts back to it. ``"raise"`` (default) refuses such a tensor by name;
            ``"warn"`` loads the nearest reciprocal with a warning naming it, and keeps the
            stored encode factor in the tree under its own name (``"...weight_global_scale"``),
            from which :func:`save` writes the original bytes back.

    Returns:
        A :class:`Checkpoint`.

    Raises:
        CheckpointError: naming the file, key or tensor: an unknown ``quant_method``, a scale
        tensor missing, unpaired or of the wrong shape or dtype, a block that does not divide
        as declared, a shard named by the index but absent, an 8-bit or packed weight without
        a quantization config.
    """
    if inexact_tensor_scales not in ("raise", "warn"):
        raise ValueError(
            f"load: inexact_tensor_scales must be 'raise' or 'warn', got {inexact_tensor_scales!r}"
        )
    path = pathlib.Path(path)
    reader = ShardedReader(path)
    config = read_json(path / CONFIG) if (path / CONFIG).exists() else {}
    hf_quant = read_json(path / MODELOPT_CONFIG) if (path / MODELOPT_CONFIG).exists() else None
    scheme = scheme_of(config.get("quantization_config"), hf_quant)
    entries = _entries(reader, scheme)
    scheme = _with_stored_scales(scheme, reader, entries)
    report = _reporter(progress)
    tensors: dict[str, Tensor] = {}
    order = {shard: i for i, shard in enumerate(reader.shards())}
    by_shard = sorted(entries, key=lambda e: order[reader.shard_of(e.names[0])])
    shard = None
    for entry in by_shard:
        if reader.shard_of(entry.names[0]) != shard:
            shard = reader.shard_of(entry.names[0])
            report(f"reading shard {order[shard] + 1}/{len(order)}: {shard}")
        arrays = [reader.get(n) for n in entry.names]
        value = (
            _weight(scheme, entry, arrays, inexact_tensor_scales) if entry.quantized else arrays[0]
        )
        tensors[entry.key] = _placed(entry.key, value, sharding)
        if entry.quantized and len(arrays) == 3 and not _exact_reciprocal(scheme, arrays[2]):
            # kept beside the MXArray, so that save writes back the stored encode factor
            tensors[entry.names[2]] = _placed(entry.names[2], arrays[2], None)
    ordered = [name for e in entries for name in (e.key, *e.names[2:]) if name in tensors]
    return Checkpoint(
        tensors={name: tensors[name] for name in ordered}, scheme=scheme, config=config
    )


def _exact_reciprocal(scheme: Scheme, stored: np.ndarray) -> bool:
    """Whether a tensor scale loads exactly: a decode factor (ModelOpt), or an encode factor
    (compressed-tensors) whose float32 reciprocal converts back to it."""
    if scheme.method != "compressed-tensors":
        return True
    value = np.asarray(stored, np.float32).reshape(-1)[0]
    return bool(np.float32(1) / (np.float32(1) / value) == value)


def _entries(reader: ShardedReader, scheme: Scheme | None) -> list[_Entry]:
    """The tree's entries, in the index's order, each quantized weight's tensors checked to be
    complete; every tensor belongs to exactly one entry."""
    names = reader.names()
    present = set(names)
    used: set[str] = set()
    quantized: dict[str, _Entry] = {}
    if scheme is not None:
        roles = _roles(scheme)
        for name in names:
            if not name.endswith(roles.scale):
                continue
            module = name[: -len(roles.scale)]
            codes = module + roles.codes
            if codes not in present:
                raise CheckpointError(f"scale tensor {name!r} has no weight {codes!r}")
            group = (codes, name)
            if roles.tensor_scale is not None:
                tensor_scale = module + roles.tensor_scale
                if tensor_scale not in present:
                    raise CheckpointError(
                        f"weight {codes!r}: its tensor scale {tensor_scale!r} is missing"
                    )
                group += (tensor_scale,)
            quantized[codes] = _Entry(module + roles.key, group, True)
            used.update(group)
    entries = []
    for name in names:
        if name in quantized:
            entries.append(quantized[name])
        elif name not in used:
            _refuse_unscaled(reader, scheme, name)
            entries.append(_Entry(name, (name,), False))
    return entries


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
    roles = _roles(scheme)
    module = name.removesuffix(roles.codes) if name.endswith(roles.codes) else name
    return module + roles.scale


def _with_stored_scales(
    scheme: Scheme | None, reader: ShardedReader, entries: list[_Entry]
) -> Scheme | None:
    """The scheme with what the config does not state but the scales show, which every weight
    must share: compressed-tensors' FP8 scale dtype (the model's) and the shape of a per-tensor
    scale (``()`` where transformers' FP8Linear allocates it, ``[1, 1]`` where its saver
    writes it, ``[1]`` in compressed-tensors)."""
    if scheme is None or scheme.weights not in ("tensor", "channel", "block"):
        return scheme
    dtypes, shapes = {}, {}
    for entry in entries:
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


def _weight(scheme: Scheme, entry: _Entry, arrays: list[np.ndarray], inexact: str) -> MXArray:
    codes, scale, *tensor_scale = arrays
    if scheme.method == "mxfp4":
        if codes.ndim < 3 or codes.shape[-1] != 16:
            raise CheckpointError(
                f"{entry.names[0]}: gpt-oss blocks are [..., out, in/32, 16], "
                f"got {list(codes.shape)}"
            )
        codes = codes.reshape(*codes.shape[:-2], codes.shape[-2] * 16)
    g = tensor_scale[0] if tensor_scale else None
    return layouts.to_mxarray(scheme, entry.key, codes, scale, g, inexact=inexact)


def _placed(name: str, value, sharding: Sharding) -> Tensor:
    """``value`` (numpy, or an MXArray of numpy leaves) on the devices ``sharding`` names,
    copied out of the memory-mapped file."""
    s = sharding(name, value) if callable(sharding) else sharding
    if isinstance(value, MXArray):
        g = value.global_scale
        return MXArray(
            _put(name, value.data, s),
            _put(f"{name} (scales)", value.scale, s),
            value.fmt,
            value.axis,
            value.shape,
            value.tile,
            None if g is None else _put(f"{name} (tensor scale)", g, _replicated(s)),
        )
    return _put(name, value, s)


def _put(name: str, x: np.ndarray, s) -> jax.Array:
    if s is None:
        return jax.device_put(np.array(x))
    try:
        return jax.make_array_from_callback(x.shape, s, lambda index: np.array(x[index]))
    except ValueError as e:
        raise CheckpointError(f"{name}: cannot place {list(x.shape)} on {s}: {e}") from None


def _replicated(s):
    if s is None or not isinstance(s, jax.sharding.NamedSharding):
        return s
    return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())


def _reporter(progress) -> Callable[[str], None]:
    if callable(progress):
        return progress
    if progress:
        return lambda line: print(f"jaxmx.checkpoints: {line}", file=sys.stderr, flush=True)
    return lambda line: None


def save(
    path: str | os.PathLike,
    tensors: Mapping[str, Tensor],
    scheme: Scheme | None = None,
    *,
    config: Mapping | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool | Callable[[str], None] = False,
) -> None:
    """Writes ``tensors`` to the directory ``path`` in the peer format ``scheme`` names, shard by
    shard (one shard's arrays on the host at a time), with ``config.json`` (``config`` plus the
    ``quantization_config``) and, for ModelOpt, ``hf_quant_config.json``.

    Args:
        path: the directory (created if needed; a previous checkpoint's shards are replaced).
        tensors: ``{name: MXArray | array}`` as :func:`load` gives them: each MXArray under its
            weight's name, in the layout ``scheme`` stores (e.g. ``fp8_e4m3_block`` in
            ``scheme.block_size`` tiles for ``Scheme(method="fp8", weights="block")``).
        scheme: the peer convention; ``None`` for a checkpoint without quantized weights.
            ``scheme.config`` (a loaded checkpoint's) is written back as it was; otherwise jaxmx
            writes the config the peer's reader expects, listing every 2-D high-precision
            ``.weight`` as unquantized (``modules_to_not_convert``, ``ignore``,
            ``exclude_modules``).
        config: the model's ``config.json`` (e.g. :attr:`Checkpoint.config`); its
            ``quantization_config`` is replaced.
        max_shard_bytes: the largest shard (a larger tensor gets a shard of its own).
        progress: as for :func:`load`.

    Raises:
        CheckpointError: naming the tensor: an MXArray without a scheme or not in its layout,
        a scale the checkpoint's scale dtype cannot hold exactly, a shape the format cannot
        pack.
    """
    path = pathlib.Path(path)
    ignore = [
        name.removesuffix(".weight")
        for name, value in tensors.items()
        if not isinstance(value, MXArray) and name.endswith(".weight") and np.ndim(value) == 2
    ]
    if scheme is None and any(isinstance(v, MXArray) for v in tensors.values()):
        name = next(n for n, v in tensors.items() if isinstance(v, MXArray))
        raise CheckpointError(f"{name}: an MXArray needs a Scheme to be written in")
    write_shards(
        path,
        _stored(tensors, scheme),
        max_shard_bytes=max_shard_bytes,
        progress=_reporter(progress),
    )
    out = {k: v for k, v in (config or {}).items() if k != "quantization_config"}
    if scheme is not None:
        out["quantization_config"] = quantization_config(scheme, ignore=ignore)
    (path / CONFIG).write_text(json.dumps(out, indent=2) + "\n")
    (path / MODELOPT_CONFIG).unlink(missing_ok=True)
    if scheme is not None and scheme.method == "modelopt":
        hf_quant = modelopt_config(scheme, ignore=ignore)
        (path / MODELOPT_CONFIG).write_text(json.dumps(hf_quant, indent=2) + "\n")


def _stored(
    tensors: Mapping[str, Tensor], scheme: Scheme | None
) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, numpy array)`` of every tensor the checkpoint stores, in ``tensors``' order.
    A plain tensor named like an MXArray's tensor scale (an inexactly loaded encode factor, see
    :func:`load`) is the MXArray's to write."""
    roles = None if scheme is None else _roles(scheme)
    kept = {}
    if roles is not None and roles.tensor_scale is not None:
        for name, value in tensors.items():
            extra = name.removesuffix(roles.key) + roles.tensor_scale
            if isinstance(value, MXArray) and not isinstance(tensors.get(extra, value), MXArray):
                kept[name] = extra
    for name, value in tensors.items():
        if not isinstance(value, MXArray):
            if name not in kept.values():
                yield name, np.asarray(value)
            continue
        if not name.endswith(roles.key):
            raise CheckpointError(f"{name}: a quantized weight's name ends in {roles.key!r}")
        module = name[: len(name) - len(roles.key)] if roles.key else name
        kept_scale = np.asarray(tensors[kept[name]]) if name in kept else None
        codes, scale, *tensor_scale = layouts.from_mxarray(scheme, name, value, kept_scale)
        if scheme.method == "mxfp4":
            codes = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 16, 16)
        if scheme.method == "mxfp8" or (scheme.method == "fp8" and scheme.scale_dtype == "ue8m0"):
            scale = scale.view(layouts.E8M0)
        yield module + roles.codes, codes
        yield module + roles.scale, scale
        if tensor_scale:
            yield module + roles.tensor_scale, tensor_scale[0]
