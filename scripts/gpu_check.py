#!/usr/bin/env python3
"""Checks jaxmx's native GEMM on a GPU machine: build report, correctness, speed.

Usage (from the repository root):

    python scripts/gpu_check.py --install   # pip-install CUDA header wheels + jaxmx, then check
    python scripts/gpu_check.py             # check the jaxmx that is installed
    python scripts/gpu_check.py --size 4096 --iters 10

Needs JAX with a CUDA backend (``pip install "jax[cuda13]"`` or ``"jax[cuda12]"``). Steps:

1. report: devices, compute capability, CUDA driver/runtime, cuBLASLt, the extension's build;
2. per-tensor FP8 (compute capability >= 8.9): ``jaxmx.ffi.fp8_matmul`` against an emulation
   computed here (decoded operands times their scales, ``jnp.dot`` in float32, HIGHEST precision)
   and against the C++ CPU handler;
3. MX (compute capability >= 10.0): ``jaxmx.ffi.mx_matmul`` against ``jaxmx.dequantize`` +
   ``jnp.dot`` in float32, and against the CPU handler, over odd shapes, E4M3/E5M2 mixes, every
   output dtype, batch dims and vmap; below 10.0 it checks the call fails with the capability
   error instead;
4. speed at ``--size``^3 (default 8192): bf16 ``jnp.dot``, the FP8 GEMM and the MX GEMM (with
   and without quantization), as TFLOP/s and as a ratio to bf16, all measured in this run.

Exits 1 if a check fails, 2 if there is no CUDA device or the cuBLASLt handler is missing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER_WHEELS = ["nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cuda-crt", "nvidia-cuda-cccl"]

FAILURES: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)


def check(name: str, ok: bool, detail: str = "") -> None:
    log(f"  [{'PASS' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}")
    if not ok:
        FAILURES.append(name)


def install() -> None:
    """Header wheels (so the cuBLASLt handler compiles), then jaxmx from this checkout."""
    pip = [sys.executable, "-m", "pip", "install"]
    log("== install: " + " ".join(HEADER_WHEELS))
    subprocess.run([*pip, *HEADER_WHEELS], check=True)
    log("== install: jaxmx (editable) from " + REPO)
    env = dict(os.environ, JAXMX_CUDA="ON")  # fail loudly if the headers are not found
    subprocess.run([*pip, "-v", "-e", REPO], check=True, env=env)


# --- report -----------------------------------------------------------------------------------


def report():
    import jax

    import jaxmx
    from jaxmx import _ffi, ffi

    log("== environment")
    import jaxlib

    log(f"  python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}")
    log(f"  jaxmx {jaxmx.__version__} from {os.path.dirname(jaxmx.__file__)}")
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        for line in smi.stdout.strip().splitlines():
            log(f"  nvidia-smi: {line}")
    except (OSError, subprocess.SubprocessError):
        log("  nvidia-smi: not available")
    try:
        gpus = jax.devices("cuda")
    except RuntimeError as e:
        gpus = []
        log(f"  no CUDA backend in JAX: {e}")
    for d in gpus:
        log(f"  device {d.id}: {d.device_kind}, compute capability {d.compute_capability}")
    if gpus:
        log(f"  XLA platform version: {getattr(gpus[0].client, 'platform_version', '?')}")
    log(f"  extension build: {_ffi.build_info()}")
    if _ffi.has_cuda:
        libs = _ffi.cuda_libraries()
        if libs["loaded"]:
            log(
                f"  loaded {libs['cublaslt']} (cuBLASLt {libs['cublaslt_version']}) and "
                f"{libs['cudart']} (CUDA runtime {libs['cudart_version']})"
            )
        else:
            log(f"  CUDA libraries: {libs['error']}")
    log(f"  backends: {ffi.backends()}")
    return gpus


# --- correctness ------------------------------------------------------------------------------


def max_error(out, ref, abs_sum, out_dtype):
    """Worst |out - ref| in units of the bound eps_out * |ref| + 2^-12 * sum|products|."""
    import numpy as np

    eps = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}[str(np.dtype(out_dtype))]
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    bound = eps * np.abs(ref) + 2.0**-12 * np.asarray(abs_sum, np.float64) + 1e-30
    return float(np.max(np.abs(out - ref) / bound))


def check_fp8(gpu, cpu, capability):
    import jax
    import jax.numpy as jnp

    from jaxmx import ffi

    if capability < (8, 9):
        log("== per-tensor FP8: skipped, cuBLASLt FP8 needs compute capability >= 8.9")
        return

    log("== per-tensor FP8 (cuBLASLt SCALAR_32F)")
    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    cases = [
        ((128, 256, 512), (e4, e4, jnp.bfloat16)),
        ((1, 4096, 1024), (e4, e5, jnp.float32)),
        ((300, 200, 96), (e5, e4, jnp.float16)),
        ((333, 77, 160), (e4, e4, jnp.float32)),
        ((2048, 2048, 2048), (e4, e4, jnp.bfloat16)),
    ]
    key = jax.random.key(0)
    for (m, n, k), (ta, tb, out_dtype) in cases:
        types = f"{jnp.dtype(ta).name} x {jnp.dtype(tb).name} -> {jnp.dtype(out_dtype).name}"
        name = f"fp8 {types} [{m}, {n}, {k}]"
        try:
            key, ka, kb = jax.random.split(key, 3)
            a8, sa = _per_tensor(jax.random.normal(ka, (m, k)), ta)
            b8, sb = _per_tensor(jax.random.normal(kb, (n, k)), tb)
            a8, b8, sa, sb = jax.device_put((a8, b8, sa, sb), gpu)
            f = jax.jit(lambda a, b, s, t, o=out_dtype: ffi.fp8_matmul(a, b, s, t, o))
            out = f(a8, b8, sa, sb)
            x, y = a8.astype(jnp.float32) * sa, b8.astype(jnp.float32) * sb
            ref = jnp.dot(x, y.T, precision="highest", preferred_element_type=jnp.float32)
            abs_sum = jnp.dot(abs(x), abs(y).T, precision="highest")
            err = max_error(out, ref, abs_sum, out_dtype)
            check(name + " vs emulation", err <= 1.0, f"error {err:.3g} of bound")
            if m * n * k <= 2**27:
                out_cpu = f(*jax.device_put((a8, b8, sa, sb), cpu))
                err = max_error(out, out_cpu, abs_sum, out_dtype)
                check(name + " vs CPU handler", err <= 1.0, f"error {err:.3g} of bound")
        except Exception as e:
            check(name, False, f"{type(e).__name__}: {e}")


def _per_tensor(x, dtype):
    import jax.numpy as jnp

    elem_max = float(jnp.finfo(dtype).max)
    scale = jnp.max(jnp.abs(x)) / elem_max
    codes = jnp.clip(x / scale, -elem_max, elem_max).astype(dtype)
    return codes, scale.astype(jnp.float32)


def check_mx(gpu, cpu, capability, small=False):
    import jax
    import jax.numpy as jnp

    import jaxmx
    from jaxmx import ffi

    log("== MX (cuBLASLt VEC32_UE8M0)")
    if capability < (10, 0):
        a = jax.device_put(jaxmx.quantize(jnp.ones((128, 64))), gpu)
        try:
            ffi.mx_matmul(a, a).block_until_ready()
            check("MX on cc < 10.0 reports the capability", False, "the call succeeded")
        except Exception as e:
            msg = str(e)
            ok = "compute capability" in msg and "10.0" in msg
            check("MX on cc < 10.0 reports the capability", ok, msg.splitlines()[0][:200])
        return
    shapes = [(128, 128, 128), (1, 256, 4096), (100, 200, 96), (257, 130, 1000), (4096, 4096, 4096)]
    combos = [
        ("mxfp8_e4m3", "mxfp8_e4m3", jnp.bfloat16),
        ("mxfp8_e4m3", "mxfp8_e5m2", jnp.float32),
        ("mxfp8_e5m2", "mxfp8_e4m3", jnp.float16),
    ]  # E5M2 x E5M2 is not in cuBLASLt's FP8 type table; jaxmx refuses it (checked below)
    key = jax.random.key(1)
    if small:
        shapes = [s for s in shapes if s[0] * s[1] * s[2] <= 2**25]
    try:
        e5 = jaxmx.quantize(jnp.ones((4, 64)), "mxfp8_e5m2")
        ffi.mx_matmul(e5, e5)
        check("mx e5m2 x e5m2 is refused", False, "it ran")
    except NotImplementedError as e:
        check("mx e5m2 x e5m2 is refused", "E5M2 x E4M3" in str(e), str(e)[:200])
    cases = [(s, c) for s in shapes for c in combos[: 3 if s[0] * s[1] * s[2] < 2**30 else 1]]
    for (m, n, k), (fa, fb, out_dtype) in cases:
        name = f"mx {fa} x {fb} -> {jnp.dtype(out_dtype).name} [{m}, {n}, {k}]"
        try:
            key, ka, kb = jax.random.split(key, 3)
            x = jax.random.normal(ka, (m, k)) * jnp.exp2(jax.random.randint(ka, (m, 1), -6, 7))
            w = jax.random.normal(kb, (n, k))
            a, b = jax.device_put((jaxmx.quantize(x, fa), jaxmx.quantize(w, fb)), gpu)
            f = jax.jit(lambda a, b, o=out_dtype: ffi.mx_matmul(a, b, o))
            out = f(a, b)
            xd, wd = jaxmx.dequantize(a), jaxmx.dequantize(b)
            ref = jnp.dot(xd, wd.T, precision="highest", preferred_element_type=jnp.float32)
            abs_sum = jnp.dot(abs(xd), abs(wd).T, precision="highest")
            err = max_error(out, ref, abs_sum, out_dtype)
            check(name + " vs emulation", err <= 1.0, f"error {err:.3g} of bound")
            if m * n * k <= 2**27:
                out_cpu = f(*jax.device_put((a, b), cpu))
                err = max_error(out, out_cpu, abs_sum, out_dtype)
                check(name + " vs CPU handler", err <= 1.0, f"error {err:.3g} of bound")
        except Exception as e:
            check(name, False, f"{type(e).__name__}: {e}")
    name = "mx batch dims and vmap"
    try:
        x = jax.random.normal(jax.random.key(2), (3, 100, 256))
        w = jax.random.normal(jax.random.key(3), (3, 72, 256))
        a, b = jax.device_put((jaxmx.quantize(x), jaxmx.quantize(w)), gpu)
        mm = jax.jit(lambda a, b: ffi.mx_matmul(a, b, jnp.float32))
        batched = mm(a, b)
        vmapped = jax.jit(jax.vmap(lambda a, b: ffi.mx_matmul(a, b, jnp.float32)))(a, b)
        ref = jnp.einsum(
            "bmk,bnk->bmn", jaxmx.dequantize(a), jaxmx.dequantize(b), precision="highest"
        )
        abs_sum = jnp.einsum(
            "bmk,bnk->bmn", abs(jaxmx.dequantize(a)), abs(jaxmx.dequantize(b)), precision="highest"
        )
        err = max(
            max_error(batched, ref, abs_sum, jnp.float32),
            max_error(vmapped, ref, abs_sum, jnp.float32),
        )
        check(name, err <= 1.0, f"error {err:.3g} of bound")
    except Exception as e:
        check(name, False, f"{type(e).__name__}: {e}")


# --- speed ------------------------------------------------------------------------------------


def bench(f, *args, iters: int) -> float:
    """Median seconds per call of a jitted f over 5 timed runs of `iters` calls."""
    f(*args).block_until_ready()  # compile
    f(*args).block_until_ready()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        out.block_until_ready()
        runs.append((time.perf_counter() - t0) / iters)
    return statistics.median(runs)


def speed(gpu, capability, size: int, iters: int) -> None:
    import jax
    import jax.numpy as jnp

    import jaxmx
    from jaxmx import ffi

    m = n = k = size
    flops = 2.0 * m * n * k
    log(f"== speed at {m} x {n} x {k} (median of 5 x {iters} calls)")
    kx, kw = jax.random.split(jax.random.key(4))
    x = jax.device_put(jax.random.normal(kx, (m, k), jnp.bfloat16), gpu)
    w = jax.device_put(jax.random.normal(kw, (n, k), jnp.bfloat16), gpu)
    rows = []
    bf16 = bench(
        jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.bfloat16)),
        x,
        w,
        iters=iters,
    )
    rows.append(("bf16 jnp.dot", bf16))
    try:
        a8, sa = _per_tensor(x.astype(jnp.float32), jnp.float8_e4m3fn)
        b8, sb = _per_tensor(w.astype(jnp.float32), jnp.float8_e4m3fn)
        fp8 = jax.jit(lambda a, b, s, t: ffi.fp8_matmul(a, b, s, t, jnp.bfloat16))
        rows.append(("fp8 per-tensor (cuBLASLt)", bench(fp8, a8, b8, sa, sb, iters=iters)))
    except Exception as e:
        log(f"  fp8 per-tensor: {type(e).__name__}: {e}")
    if capability >= (10, 0):
        try:
            a, b = jaxmx.quantize(x), jaxmx.quantize(w)
            mx = jax.jit(lambda a, b: ffi.mx_matmul(a, b, jnp.bfloat16))
            rows.append(("mxfp8 (cuBLASLt), pre-quantized", bench(mx, a, b, iters=iters)))
            mxq = jax.jit(lambda x, w: ffi.mx_matmul(jaxmx.quantize(x), jaxmx.quantize(w)))
            rows.append(("mxfp8 (cuBLASLt), quantize included", bench(mxq, x, w, iters=iters)))
        except Exception as e:
            log(f"  mxfp8: {type(e).__name__}: {e}")
    for name, t in rows:
        rate = flops / t / 1e12
        log(f"  {name:38s} {t * 1e3:8.3f} ms  {rate:8.1f} TFLOP/s  {bf16 / t:5.2f}x bf16")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", action="store_true", help="pip-install header wheels + jaxmx")
    parser.add_argument("--size", type=int, default=8192, help="M = N = K of the timing problem")
    parser.add_argument("--iters", type=int, default=20, help="calls per timed run")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run every step with the CPU standing in for the GPU (tests this script, not CUDA)",
    )
    args = parser.parse_args()
    if args.install:
        install()
        argv = [a for a in sys.argv[1:] if a != "--install"]
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *argv])

    import jax

    gpus = report()
    if args.cpu_dry_run:
        cpu = jax.devices("cpu")[0]
        log("== CPU dry run: the CPU handler stands in for cuBLASLt, as if compute capability 10.0")
        check_fp8(cpu, cpu, (10, 0))
        check_mx(cpu, cpu, (10, 0), small=True)
        if not args.skip_speed:
            speed(cpu, (10, 0), args.size, args.iters)
        log("== result: " + ("all checks passed" if not FAILURES else f"FAILED: {FAILURES}"))
        return 1 if FAILURES else 0
    if not gpus:
        log("no CUDA device: nothing to check (install jax[cuda13] on a GPU machine)")
        return 2
    from jaxmx import _ffi

    if not _ffi.has_cuda:
        log("jaxmx._ffi was built without the cuBLASLt handler: rerun with --install")
        return 2
    gpu, cpu = gpus[0], jax.devices("cpu")[0]
    jax.config.update("jax_default_device", gpu)
    cc = tuple(int(p) for p in str(gpu.compute_capability).split(".")[:2])
    for step in (lambda: check_fp8(gpu, cpu, cc), lambda: check_mx(gpu, cpu, cc)):
        try:
            step()
        except Exception:
            traceback.print_exc()
            FAILURES.append("unexpected exception")
    if not args.skip_speed:
        speed(gpu, cc, args.size, args.iters)
    log("== result: " + ("all checks passed" if not FAILURES else f"FAILED: {FAILURES}"))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
