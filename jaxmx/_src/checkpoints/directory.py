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
import os
import pathlib
import sys
from collections.abc import Callable, Mapping

import numpy as np

from jaxmx._src.checkpoints.entries import entries, with_stored_scales
from jaxmx._src.checkpoints.placement import Sharding, Tensor, placed
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
from jaxmx._src.checkpoints.stored_weights import exact_reciprocal, stored, weight
from jaxmx._src.core.mxarray import MXArray

CONFIG = "config.json"
MODELOPT_CONFIG = "hf_quant_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


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
    found = entries(reader, scheme)
    scheme = with_stored_scales(scheme, reader, found)
    report = _reporter(progress)
    tensors: dict[str, Tensor] = {}
    order = {shard: i for i, shard in enumerate(reader.shards())}
    by_shard = sorted(found, key=lambda e: order[reader.shard_of(e.names[0])])
    shard = None
    for entry in by_shard:
        if reader.shard_of(entry.names[0]) != shard:
            shard = reader.shard_of(entry.names[0])
            report(f"reading shard {order[shard] + 1}/{len(order)}: {shard}")
        arrays = [reader.get(n) for n in entry.names]
        value = (
            weight(scheme, entry, arrays, inexact_tensor_scales) if entry.quantized else arrays[0]
        )
        tensors[entry.key] = placed(entry.key, value, sharding)
        if entry.quantized and len(arrays) == 3 and not exact_reciprocal(scheme, arrays[2]):
            # kept beside the MXArray, so that save writes back the stored encode factor
            tensors[entry.names[2]] = placed(entry.names[2], arrays[2], None)
    ordered = [name for e in found for name in (e.key, *e.names[2:]) if name in tensors]
    return Checkpoint(
        tensors={name: tensors[name] for name in ordered}, scheme=scheme, config=config
    )


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
        stored(tensors, scheme),
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
