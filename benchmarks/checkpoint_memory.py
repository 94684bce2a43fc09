"""Host memory of loading a checkpoint: jaxmx.checkpoints.load against reading every shard whole
(the naive load: all shards' tensors in host memory, then put on the device), each in a fresh
process, on a synthetic block-FP8 checkpoint of several shards.

Prints, per way of loading, the peak resident memory above the process's resident memory before
the load, in MiB and in shards, after subtracting the loaded model itself (on the CPU backend the
device arrays are host memory too): what a load costs beyond its result.

    python benchmarks/checkpoint_memory.py [--shards 4] [--shard-mib 128]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

MiB = 2**20


def _status_mib(field: str) -> float:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in MiB (Linux)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_mib() -> float:
    """The resident set size of this process now, in MiB."""
    return _status_mib("VmRSS")


def reset_peak() -> None:
    """Sets the process's peak resident size (VmHWM) to its current one (Linux >= 4.0), so that
    the peak of the imports does not count."""
    pathlib.Path("/proc/self/clear_refs").write_text("5")


def peak_mib() -> float:
    """The peak resident set size since :func:`reset_peak`, in MiB."""
    return _status_mib("VmHWM")


def write(path: pathlib.Path, shards: int, shard_mib: int) -> int:
    """A block-FP8 checkpoint of ``shards`` shards of about ``shard_mib`` MiB; its bytes."""
    import jax.numpy as jnp
    import numpy as np

    import jaxmx
    from jaxmx import checkpoints

    side = 4096
    per_weight = side * side  # 16 MiB of E4M3 codes
    n = max(1, shards * shard_mib * MiB // per_weight)
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(n):
        w = jnp.asarray(rng.standard_normal((side, side), np.float32))
        tensors[f"model.layers.{i}.mlp.proj.weight"] = jaxmx.quantize(
            w, "fp8_e4m3_block", tile=(128, 128)
        )
    checkpoints.save(
        path,
        tensors,
        checkpoints.Scheme(method="fp8", weights="block"),
        max_shard_bytes=shard_mib * MiB,
    )
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def child(path: str, way: str) -> None:
    """Loads ``path`` one ``way`` and prints the memory figures as JSON."""
    import jax
    import numpy as np

    from jaxmx import checkpoints
    from jaxmx._src.checkpoints.safetensors_files import ShardedReader

    jax.device_put(np.zeros(4)).block_until_ready()  # the backend up before the baseline
    reset_peak()
    before = rss_mib()
    if way == "jaxmx":
        tensors = checkpoints.load(path).tensors
    else:  # every shard's tensors copied into host memory, then put on the device
        reader = ShardedReader(path)
        host = {name: np.array(reader.get(name)) for name in reader.names()}
        tensors = {name: jax.device_put(x) for name, x in host.items()}
        del host
    leaves = jax.tree.leaves(tensors)
    jax.block_until_ready(leaves)
    loaded = sum(x.nbytes for x in leaves) / MiB
    print(json.dumps({"before": before, "peak": peak_mib(), "loaded": loaded}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mib", type=int, default=128)
    parser.add_argument("--child", nargs=2, metavar=("PATH", "WAY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp)
        size = write(path, args.shards, args.shard_mib)
        files = sorted(p.name for p in path.glob("*.safetensors"))
        print(f"checkpoint: {size / MiB:.0f} MiB in {len(files)} shards of <= {args.shard_mib} MiB")
        results = {}
        for way in ("naive", "jaxmx"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(path), way],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            extra = r["peak"] - r["before"] - r["loaded"]
            results[way] = extra
            print(
                f"{way:>6}: peak {r['peak'] - r['before']:7.0f} MiB above the start, "
                f"{extra:7.0f} MiB beyond the loaded model ({r['loaded']:.0f} MiB) = "
                f"{extra / args.shard_mib:.2f} shards"
            )
        print(f"jaxmx / naive extra memory: {results['jaxmx'] / results['naive']:.2f}x")


if __name__ == "__main__":
    main()
