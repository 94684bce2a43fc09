"""The tensors of a checkpoint directory as bytes, read from the safetensors file format directly
(8-byte header size, JSON header, data): what "byte for byte" is checked against."""

import json
import pathlib
import struct


def raw_tensors(path) -> dict[str, tuple[str, list[int], bytes]]:
    """``{name: (safetensors dtype, shape, bytes)}`` of every ``*.safetensors`` file under
    ``path``."""
    out = {}
    for file in sorted(pathlib.Path(path).glob("*.safetensors")):
        blob = file.read_bytes()
        n = struct.unpack("<Q", blob[:8])[0]
        header = json.loads(blob[8 : 8 + n])
        header.pop("__metadata__", None)
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            out[name] = (entry["dtype"], entry["shape"], blob[8 + n + begin : 8 + n + end])
    return out
