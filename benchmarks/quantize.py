"""Quantize throughput in GB/s of the bytes that must move, against a copy of the same tensor.

For each N, on an [N, N] bfloat16 tensor, times (jitted, medians over interleaved repeats):

- ``copy``: ``x * 2`` (read bf16, write bf16), a device-to-device copy of the input that XLA
  cannot elide: the bandwidth to compare with;
- ``quantize``: one copy along the last axis, in each format of ``--formats`` (default
  ``mxfp8_e4m3``; its default scale rule unless ``--scale-mode``);
- ``row+col``: ``quantize_rowwise_colwise``, both copies (the second one physically transposed);

each with every implementation asked for (``--impls``; default ``xla``: the Pallas kernels are
refused on GPUs (``jaxmx._src.quantize.impl.PALLAS_ON_GPU``) and run interpreted on the CPU,
which is for tests, not speed).
Each is printed as median wall milliseconds, GB/s of the bytes that must move (input read once;
data + scales written: 1 byte per E4M3 / E5M2 element, 1/2 per E2M1 element (packed), 1 byte
per E8M0 or E4M3 scale, 4 per float32 scale) and that bandwidth as a fraction of the copy's. The
process CPU time (all threads) is printed too: on a shared machine it is less sensitive to other
jobs than wall time.

Usage:
    python benchmarks/quantize.py                       # 4096 x 4096
    python benchmarks/quantize.py --sizes 1024 2048 4096 8192 --repeats 20
    python benchmarks/quantize.py --formats mxfp8_e4m3 mxfp4 nvfp4 fp8_e4m3_block
    python benchmarks/quantize.py --breakdown             # plus the pieces of the cost (XLA)
    python benchmarks/quantize.py --fake                  # plus fake_quantize vs dq(q(x))
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
from timing import interleaved_medians

import jaxmx


def _element_bytes(f) -> float:
    return f.bits / 8


def _copy_bytes(f, size: int) -> float:
    """Bytes written by one quantized copy of ``size`` elements: codes and block scales."""
    return size * _element_bytes(f) + size / f.block * f.scale_dtype.itemsize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096])
    parser.add_argument("--formats", nargs="+", default=["mxfp8_e4m3"], choices=list(jaxmx.FORMATS))
    parser.add_argument("--scale-mode", help="the scale rule (default: each format's own)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--impls",
        nargs="+",
        choices=["xla", "pallas"],
        help="quantizer implementations (default: xla; pallas runs interpreted on the CPU only)",
    )
    parser.add_argument(
        "--fake",
        action="store_true",
        help="also time fake_quantize and dequantize(quantize(x)) (the same float32 values; "
        "the first format)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the pieces: block amax, saturating fp8 cast, bf16 transpose, quantize "
        "along axis 0 (no transpose), quantize of x.reshape(N, N/32, 32) (same bytes); the "
        "first format",
    )
    args = parser.parse_args()

    mode = args.scale_mode
    impls = args.impls or ["xla"]
    fns = {"copy": jax.jit(lambda x: x * 2)}
    for fmt in args.formats:
        for impl in impls:
            fns[f"{fmt} {impl}"] = jax.jit(
                lambda x, fmt=fmt, impl=impl: jaxmx.quantize(
                    x, fmt, axis=-1, scale_mode=mode, impl=impl
                )
            )
            fns[f"{fmt} row+col {impl}"] = jax.jit(
                lambda x, fmt=fmt, impl=impl: jaxmx.quantize_rowwise_colwise(
                    x, fmt, mode, impl=impl
                )
            )
    fmt = args.formats[0]  # the format of --fake and --breakdown
    first = jaxmx.FORMATS[fmt]
    dtype, elem_max, block = first.dtype, first.elem_max, first.block
    if args.fake:
        fns |= {
            "fake_quantize": jax.jit(lambda x: jaxmx.fake_quantize(x, fmt, -1, mode)),
            "dq(q(x))": jax.jit(lambda x: jaxmx.dequantize(jaxmx.quantize(x, fmt, -1, mode))),
        }
    if args.breakdown:
        fns |= {
            "amax": jax.jit(lambda x: jnp.max(jnp.abs(x.reshape(*x.shape[:-1], -1, block)), -1)),
            "cast": jax.jit(lambda x: jnp.clip(x, -elem_max, elem_max).astype(dtype)),
            "x.T": jax.jit(lambda x: x.T),
            "q axis 0": jax.jit(lambda x: jaxmx.quantize(x, fmt, 0, mode, impl="xla")),
            "q 3-D": jax.jit(
                lambda x: jaxmx.quantize(
                    x.reshape(x.shape[0], -1, block), fmt, -1, mode, impl="xla"
                )
            ),
        }

    dev = jax.devices()[0]
    print(
        f"jax {jax.__version__}, {dev.platform} ({dev.device_kind}, {os.cpu_count()} cores), "
        f"scale rule {mode or 'per format'}, bfloat16 [N, N] input; medians of "
        f"{args.repeats} interleaved repeats after {args.warmup} warmups; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    header = (
        f"| {'N':>5} | {'op':<27} | {'wall ms':>8} | {'GB/s':>7} | {'x copy GB/s':>11} "
        f"| {'cpu ms':>8} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for n in args.sizes:
        x = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
        t = interleaved_medians(fns, (x,), args.repeats, args.warmup)
        wall = {name: timing.seconds for name, timing in t.items()}
        cpu = {name: timing.cpu_seconds for name, timing in t.items()}
        size = n * n
        first_copy = _copy_bytes(first, size)
        moved = {
            "copy": 2 * size + 2 * size,
            "amax": 2 * size + size / block * 2,
            "cast": 2 * size + size * _element_bytes(first),
            "x.T": 2 * size + 2 * size,
            "q axis 0": 2 * size + first_copy,
            "q 3-D": 2 * size + first_copy,
            "fake_quantize": 2 * size + 4 * size,  # read bf16, write float32
            "dq(q(x))": 2 * size + 4 * size,
        }
        for f in args.formats:
            for impl in impls:
                moved[f"{f} {impl}"] = 2 * size + _copy_bytes(jaxmx.FORMATS[f], size)
                moved[f"{f} row+col {impl}"] = 2 * size + 2 * _copy_bytes(jaxmx.FORMATS[f], size)
        copy_rate = moved["copy"] / wall["copy"]
        for name in fns:
            rate = moved[name] / wall[name]
            print(
                f"| {n:>5} | {name:<27} | {wall[name] * 1e3:>8.3f} | {rate / 1e9:>7.1f} "
                f"| {rate / copy_rate:>11.2f} | {cpu[name] * 1e3:>8.2f} |"
            )


if __name__ == "__main__":
    main()
