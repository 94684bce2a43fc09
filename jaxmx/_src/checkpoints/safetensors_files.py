"""Safetensors shards on disk: a lazy reader over one file or an index of shards, and a writer
that fills shards one at a time.

The reader parses each shard's header itself and memory-maps the file: ``safetensors.numpy``
(0.8) cannot return the 8-bit float dtypes (``np.float8_e4m3fn`` does not exist in numpy), and a
memory map reads a tensor's bytes only when they are used. The writer is
``safetensors.numpy.save_file``, one shard at a time, which writes the ml_dtypes types under their
safetensors names (``F8_E4M3``, ``F8_E8M0``...).

Example:
    >>> import json, pathlib, tempfile
    >>> import numpy as np
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> write_shards(d, {"a": np.ones((2, 3), np.float32)}.items(), max_shard_bytes=1 << 20)
    ['model.safetensors']
    >>> reader = ShardedReader(d)
    >>> reader.names(), reader.get("a").sum()
    (['a'], np.float32(6.0))
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
"""The safetensors dtype names this reader maps to numpy (ml_dtypes for the narrow floats)."""

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written as asked; the message names the file or
    tensor and the problem."""


class ShardedReader:
    """The tensors of a directory holding ``model.safetensors`` or
    ``model.safetensors.index.json`` plus the shards it names, read lazily: a shard's header is
    parsed when one of its tensors is first asked for, and :meth:`get` returns a read-only view
    of the memory-mapped file (no copy).

    Raises :class:`CheckpointError` naming the file for a missing shard, a header that is not
    safetensors, or an index entry absent from its shard.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        index = self.path / INDEX
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map' object")
            self._shard_of = dict(weight_map)
        elif (self.path / SINGLE).exists():
            self._shard_of = {name: SINGLE for name in _header(self.path / SINGLE)[0]}
        else:
            raise CheckpointError(f"{self.path}: neither {INDEX} nor {SINGLE} is there")
        for shard in sorted(set(self._shard_of.values())):
            if not (self.path / shard).exists():
                names = [n for n, s in self._shard_of.items() if s == shard]
                raise CheckpointError(
                    f"{index}: shard {shard!r} (holding {names[0]!r} and {len(names) - 1} more "
                    "tensors) is missing"
                )
        self._headers: dict[str, tuple[dict, int]] = {}

    def names(self) -> list[str]:
        """Every tensor name, in the index's order."""
        return list(self._shard_of)

    def shards(self) -> list[str]:
        """The shard files, in order."""
        return sorted(set(self._shard_of.values()))

    def shard_of(self, name: str) -> str:
        return self._shard_of[name]

    def info(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        """``(dtype, shape)`` of tensor ``name`` from its shard's header (no data read)."""
        entry = self._entry(name)
        return _dtype(entry, name), tuple(entry["shape"])

    def get(self, name: str) -> np.ndarray:
        """Tensor ``name``: a read-only numpy view of its bytes in the memory-mapped shard."""
        entry = self._entry(name)
        dtype, shape = _dtype(entry, name), tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(
                f"tensor {name!r}: {end - begin} bytes for {entry['dtype']} {list(shape)}"
            )
        _, start = self._header_of(self._shard_of[name])
        path = self.path / self._shard_of[name]
        if end == begin:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype, "r", offset=start + begin, shape=shape)

    def _entry(self, name: str) -> dict:
        if name not in self._shard_of:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint at {self.path}")
        header, _ = self._header_of(self._shard_of[name])
        if name not in header:
            raise CheckpointError(
                f"tensor {name!r}: the index places it in {self._shard_of[name]!r}, which does "
                "not hold it"
            )
        return header[name]

    def _header_of(self, shard: str) -> tuple[dict, int]:
        if shard not in self._headers:
            self._headers[shard] = _header(self.path / shard)
        return self._headers[shard]


def read_json(path: pathlib.Path) -> dict:
    """The JSON object in the file ``path``, or a :class:`CheckpointError` naming the file."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def _header(path: pathlib.Path) -> tuple[dict, int]:
    """``({name: entry}, offset of the data)`` of a safetensors file."""
    with open(path, "rb") as file:
        head = file.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size < 1 << 27:
            raise CheckpointError(f"{path}: not a safetensors file (header size {size})")
        try:
            header = json.loads(file.read(size))
        except ValueError as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + size


def _dtype(entry: dict, name: str) -> np.dtype:
    if entry.get("dtype") not in DTYPES:
        raise CheckpointError(
            f"tensor {name!r}: safetensors dtype {entry.get('dtype')!r} is not one jaxmx reads "
            f"({sorted(DTYPES)})"
        )
    return DTYPES[entry["dtype"]]


def write_shards(
    path: str | os.PathLike,
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    max_shard_bytes: int,
    progress: Callable[[str], None] | None = None,
) -> list[str]:
    """Writes ``tensors`` (name, numpy array) to ``path`` in order, a new shard whenever the
    next tensor would take the current one past ``max_shard_bytes`` (one tensor larger than that
    gets a shard of its own): ``model.safetensors`` if one shard is enough, else
    ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``. Only one
    shard's arrays are held at a time. Returns the shard file names."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    written: list[tuple[str, list[str], int]] = []  # (temporary name, tensor names, bytes)
    shard: dict[str, np.ndarray] = {}
    size = 0

    def flush():
        nonlocal shard, size
        name = f".jaxmx-shard-{len(written)}.tmp"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        written.append((name, list(shard), size))
        if progress is not None:
            progress(f"wrote shard {len(written)} ({size / 2**20:.1f} MiB)")
        shard, size = {}, 0

    for name, array in tensors:
        if name in shard or any(name in names for _, names, _ in written):
            raise CheckpointError(f"tensor {name!r} is written twice")
        if shard and size + array.nbytes > max_shard_bytes:
            flush()
        shard[name] = np.require(array, requirements="C")  # keeps 0-d (ascontiguousarray: 1-d)
        size += array.nbytes
    if shard or not written:
        flush()
    for stale in [SINGLE, INDEX, *(p.name for p in path.glob("model-*-of-*.safetensors"))]:
        (path / stale).unlink(missing_ok=True)
    if len(written) == 1:
        os.replace(path / written[0][0], path / SINGLE)
        return [SINGLE]
    files = [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
    weight_map = {}
    for (temporary, names, _), final in zip(written, files, strict=True):
        os.replace(path / temporary, path / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": sum(s for *_, s in written)}, "weight_map": weight_map}
    (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files
