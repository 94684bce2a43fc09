"""Speed of the native GEMMs on a CUDA device, as TFLOP/s and as a ratio to bf16 ``jnp.dot``
measured in the same run: per-tensor FP8 (with and without fast accumulation) and, where the
device runs it, MXFP8 (pre-quantized, and with quantization in the timed step).

Each timed GEMM's output is also checked against the float32 GEMM of its decoded operands (the
error bound of tests/gpu); the script exits 1 if one is off. The correctness suite is
``python -m pytest -q -n 0 -m gpu tests/gpu`` (docs/native.md).

    python benchmarks/native_gemm.py                 # 8192^3, 20 calls per timed run
    python benchmarks/native_gemm.py --size 4096 --iters 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxmx
from jaxmx import ffi
from jaxmx._src.gemm import capabilities


def bench(f, *args, iters: int) -> float:
    """Median seconds per call of a jitted ``f`` over 5 timed runs of ``iters`` calls, after
    two untimed calls (the first compiles).

    Example:
        >>> bench(jax.jit(lambda x: x + 1), jnp.ones(4), iters=2) > 0
        True
    """
    f(*args).block_until_ready()
    f(*args).block_until_ready()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        out.block_until_ready()
        runs.append((time.perf_counter() - start) / iters)
    return statistics.median(runs)


def bound_fraction(out, xd, wd) -> float:
    """Worst ``|out - ref|`` in units of ``2^-8 |ref| + 2^-10 sum|products|`` (bfloat16 output of
    the tensor cores' accumulation, tests/gpu/gpu_helpers.py's ``ACCUMULATION``); <= 1 is within
    the bound.

    Example:
        >>> x = jnp.ones((2, 4))
        >>> bound_fraction(jnp.full((2, 2), 4.0), x, x)
        0.0
    """
    hi = dict(precision="highest", preferred_element_type=jnp.float32)
    ref = np.asarray(jnp.dot(xd, wd.T, **hi), np.float64)
    abs_sum = np.asarray(jnp.dot(abs(xd), abs(wd).T, **hi), np.float64)
    bound = 2.0**-8 * np.abs(ref) + 2.0**-10 * abs_sum + 2.0**-134
    return float(np.max(np.abs(np.asarray(out, np.float64) - ref) / bound))


def per_tensor(x, dtype=jnp.float8_e4m3fn):
    elem_max = float(jnp.finfo(dtype).max)
    scale = jnp.max(jnp.abs(x)) / elem_max
    return jnp.clip(x / scale, -elem_max, elem_max).astype(dtype), scale.astype(jnp.float32)


def timed_gemms(x, w) -> dict:
    """``{label: (jitted f, its arguments, decoded lhs, decoded rhs)}`` of the GEMMs this
    device runs natively, bf16 ``jnp.dot`` first."""
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    gemms = {"bf16 jnp.dot": (jax.jit(lambda x, w: x @ w.T), (x, w), x32, w32)}
    here = capabilities.probe()
    if here.supports("fp8"):
        (a8, sa), (b8, sb) = per_tensor(x32), per_tensor(w32)
        xs, ws = a8.astype(jnp.float32) * sa, b8.astype(jnp.float32) * sb
        for fast in (False, True):
            f = jax.jit(lambda a, b, s, t, f=fast: ffi.fp8_matmul(a, b, s, t, fast_accum=f))
            label = "fp8 per-tensor" + (", fast accumulation" if fast else "")
            gemms[label] = (f, (a8, b8, sa, sb), xs, ws)
    if here.supports("mx"):
        a, b = jaxmx.quantize(x), jaxmx.quantize(w)
        xd, wd = jaxmx.dequantize(a), jaxmx.dequantize(b)
        mx = jax.jit(lambda a, b: ffi.mx_matmul(a, b))
        gemms["mxfp8, pre-quantized"] = (mx, (a, b), xd, wd)
        mxq = jax.jit(lambda x, w: ffi.mx_matmul(jaxmx.quantize(x), jaxmx.quantize(w)))
        gemms["mxfp8, quantize included"] = (mxq, (x, w), xd, wd)
    return gemms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=8192, help="M = N = K")
    parser.add_argument("--iters", type=int, default=20, help="calls per timed run")
    args = parser.parse_args()
    here = capabilities.probe()
    if here.compute_capability is None:
        print(f"no native GEMM to time: {here.no_device}")
        return 2
    print(f"{jax.devices('cuda')[0].device_kind}, fp8: {here.status('fp8')}, "
          f"mx: {here.status('mx')}")  # fmt: skip
    n = args.size
    kx, kw = jax.random.split(jax.random.key(4))
    x = jax.random.normal(kx, (n, n), jnp.bfloat16)
    w = jax.random.normal(kw, (n, n), jnp.bfloat16)
    print(f"{n} x {n} x {n}, median of 5 x {args.iters} calls")
    failed = []
    bf16 = None
    for label, (f, operands, xd, wd) in timed_gemms(x, w).items():
        seconds = bench(f, *operands, iters=args.iters)
        bf16 = bf16 or seconds
        err = bound_fraction(f(*operands), xd, wd)
        if err > 1.0:
            failed.append(label)
        print(f"  {label:28s} {seconds * 1e3:8.3f} ms {2.0 * n**3 / seconds / 1e12:8.1f} TFLOP/s "
              f"{bf16 / seconds:5.2f}x bf16   error {err:.2g} of the bound")  # fmt: skip
    if failed:
        print(f"outputs off the bound: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
