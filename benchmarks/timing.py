"""Timing shared by the benchmark scripts: interleaved medians, page faults and the allocator.

On the CPU, XLA allocates the temporaries of each call in one block. glibc's malloc serves a
block above 32 MiB with a fresh ``mmap`` and unmaps it when the call ends, so every call touches
its temporaries' pages anew: a minor page fault (a kernel-zeroed page) per 4 KiB. A step whose
temporaries are large pays this on every call, a step without temporaries (a plain GEMM on its
arguments) does not. ``--malloc pooled`` re-runs the script with glibc settings that keep freed
memory in the process (one arena, no mmap, no trimming), as a caching allocator (tcmalloc,
jemalloc) would; the ``faults`` columns show what each variant pays.

Example:
    >>> import jax.numpy as jnp
    >>> t = interleaved_medians({"sum": lambda x: x.sum()}, (jnp.ones(8),), repeats=3)
    >>> sorted(t), t["sum"].seconds > 0
    (['sum'], True)
"""

from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import sys
import time

import jax

POOLED_MALLOC = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**40),
}
"""glibc malloc settings that keep freed memory for reuse (read when the process starts)."""

MALLOC_CHOICES = ("default", "pooled")


def use_malloc(choice: str) -> None:
    """With ``"pooled"``, re-executes this script under :data:`POOLED_MALLOC` unless it already
    runs under it; ``"default"`` leaves the process as it is."""
    if choice == "pooled" and malloc_setting() != "pooled":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **POOLED_MALLOC})


def malloc_setting() -> str:
    """``"pooled"`` where every :data:`POOLED_MALLOC` setting is in effect, else ``"default"``."""
    pooled = all(os.environ.get(k) == v for k, v in POOLED_MALLOC.items())
    return "pooled" if pooled else "default"


@dataclasses.dataclass(frozen=True)
class Timing:
    seconds: float  # median wall time of one call
    cpu_seconds: float  # median process CPU time of one call (all threads)
    faults: float  # median minor page faults of one call (the whole process)


def interleaved_medians(fns: dict, args, repeats: int, warmup: int = 1) -> dict[str, Timing]:
    """Median wall time, CPU time and page faults per call of each function over ``repeats``
    rounds of one call each (interleaved, so that drift in the machine's load hits all of them
    alike), after ``warmup`` calls of each (the first compiles)."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            wall, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*args))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            samples[name].append((wall, cpu, faults))
    return {
        name: Timing(*(statistics.median(column) for column in zip(*rows, strict=True)))
        for name, rows in samples.items()
    }
