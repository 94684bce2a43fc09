#!/usr/bin/env python3
"""Checks jaxmx's native GEMM on a GPU machine: build report, correctness, speed.

Usage (from the repository root):

    python scripts/gpu_check.py --install   # build + install jaxmx from this checkout, then check
    python scripts/gpu_check.py             # check the jaxmx that is installed
    python scripts/gpu_check.py --size 4096 --iters 10

Needs JAX with a CUDA backend (``jax[cuda13]`` or ``jax[cuda12]``), and for ``--install`` the
build tools and CUDA header wheels already installed (``--install`` uses no network; it names
what is missing). Runs in under 5 minutes on one GPU and prints its run time. Steps:

1. report: devices, compute capability, CUDA driver/runtime, cuBLASLt, the extension's build;
2. per-tensor FP8 (compute capability >= 8.9): ``jaxmx.ffi.fp8_matmul`` against an emulation
   computed here (decoded operands times their scales, ``jnp.dot`` in float32, HIGHEST precision)
   and against the C++ CPU handler, including a batched call with one scale per batch element,
   and on hosts with several GPUs a call on each device;
3. MX (compute capability >= 10.0): ``jaxmx.ffi.mx_matmul`` against ``jaxmx.dequantize`` +
   ``jnp.dot`` in float32, and against the CPU handler, over odd shapes, E4M3/E5M2 mixes, every
   output dtype, operands whose exponents vary per row and per block on both sides, batch dims
   and vmap, and against ``jax.nn.scaled_matmul`` (cuDNN); below 10.0 it checks the call fails
   with the capability error instead;
   and on compute capability 10.x with K-first (non-TN) operands, which go to cuBLASLt
   untransposed there (``lhs_k_first`` / ``rhs_k_first`` in the lowered call), against the CPU
   handler and the emulation (skipped with a message elsewhere: sm_12x keeps the all-TN path);
4. block FP8 (compute capability 9.x): ``jaxmx.ffi.block_fp8_matmul`` with 1x128 x 128x128
   (forward, dgrad shapes), 1x128 x 1x128 (wgrad), 128x128 x 1x128 and E5M2 x E4M3 scales
   against ``jaxmx.dequantize`` + ``jnp.dot`` and the CPU handler, and ``DEEPSEEK_FP8``'s
   forward and backward GEMMs with ``backend="ffi"`` against ``"emulate"``; elsewhere it checks
   the call fails with the capability error;
5. FP4 (compute capability >= 10.0): ``jaxmx.ffi.fp4_matmul`` on NVFP4 and MXFP4 operands
   (cuBLASLt VEC16_UE4M3 / VEC32_UE8M0 on packed E2M1) against ``jaxmx.dequantize`` +
   ``jnp.dot`` and against the CPU handler, over odd shapes, K padded, every output dtype, batch
   dims and vmap; below 10.0 it checks the call fails cleanly with the capability error
   ("not supported on this device");
6. CUDA graphs: the GEMMs jitted in a fresh process with XLA's command buffers enabled for
   custom calls, on new shapes, run twice with different operands;
7. speed at ``--size``^3 (default 8192): bf16 ``jnp.dot``, the FP8 GEMM and the MX GEMM (with
   and without quantization), as TFLOP/s and as a ratio to bf16, all measured in this run, and
   the outputs of the timed GEMMs checked against the emulation.

Exits 1 if a check fails, 2 if there is no CUDA device or the cuBLASLt handler is missing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER_WHEELS = ["nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cuda-crt", "nvidia-cuda-cccl"]
BUILD_TOOLS = ["scikit-build-core", "nanobind"]
TIME_BUDGET_S = 300
GRAPH_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"

FAILURES: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)


def check(name: str, ok: bool, detail: str = "") -> None:
    log(f"  [{'PASS' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}")
    if not ok:
        FAILURES.append(name)


def missing_for_install() -> list[str]:
    """The packages a network-free build of jaxmx with the cuBLASLt handler needs and lacks."""
    missing = []
    for name in HEADER_WHEELS + BUILD_TOOLS:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if shutil.which("cmake") is None:
        try:
            importlib.metadata.distribution("cmake")
        except importlib.metadata.PackageNotFoundError:
            missing.append("cmake")
    return missing


def install() -> None:
    """jaxmx from this checkout with the cuBLASLt handler, without network access (no build
    isolation, no index): the header wheels and build tools must already be installed."""
    missing = missing_for_install()
    if missing:
        log("== install: missing " + ", ".join(missing) + "; install them first (this needs")
        log("   network): python -m pip install " + " ".join(missing))
        sys.exit(2)
    log("== install: jaxmx (editable, JAXMX_CUDA=ON, no network) from " + REPO)
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--no-build-isolation"]
    env = dict(os.environ, JAXMX_CUDA="ON")  # fail loudly if the headers are not found
    subprocess.run([*pip, "--no-deps", "-v", "-e", REPO], check=True, env=env)


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
    """Worst |out - ref| in units of the bound eps_out * |ref| + 2^-12 * sum|products| + tiny_out
    (tiny_out: half the spacing of the output type's subnormals)."""
    import numpy as np

    name = str(np.dtype(out_dtype))
    eps = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}[name]
    tiny = {"float32": 2.0**-150, "bfloat16": 2.0**-134, "float16": 2.0**-25}[name]
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    bound = eps * np.abs(ref) + 2.0**-12 * np.asarray(abs_sum, np.float64) + tiny
    return float(np.max(np.abs(out - ref) / bound))


def check_native_gemm(name, f, a, b, out_dtype, cpu, with_cpu: bool) -> None:
    """``f(a, b)`` (a native GEMM on the GPU) against the float32 dot of the dequantized operands
    and, ``with_cpu``, against the same call on the CPU handler."""
    import jax
    import jax.numpy as jnp

    import jaxmx

    out = f(a, b)
    xd, wd = jaxmx.dequantize(a), jaxmx.dequantize(b)
    ref = jnp.dot(xd, wd.T, precision="highest", preferred_element_type=jnp.float32)
    abs_sum = jnp.dot(abs(xd), abs(wd).T, precision="highest")
    err = max_error(out, ref, abs_sum, out_dtype)
    check(name + " vs emulation", err <= 1.0, f"error {err:.3g} of bound")
    if with_cpu:
        err = max_error(out, f(*jax.device_put((a, b), cpu)), abs_sum, out_dtype)
        check(name + " vs CPU handler", err <= 1.0, f"error {err:.3g} of bound")


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
    check_fp8_batched(gpu, cpu)
    probe_unpadded_n(gpu)


def check_fp8_batched(gpu, cpu):
    """[3, M, K] x [3, N, K] with one scale pair per batch element (per-batch cuBLASLt calls)."""
    import jax
    import jax.numpy as jnp

    from jaxmx import ffi

    name = "fp8 batched [3, 96, 80, 64], one scale per batch element"
    try:
        ka, kb = jax.random.split(jax.random.key(5))
        x = jax.random.normal(ka, (3, 96, 64)) * jnp.asarray([1.0, 2.0**-8, 2.0**6])[:, None, None]
        w = jax.random.normal(kb, (3, 80, 64)) * jnp.asarray([2.0**5, 1.0, 2.0**-4])[:, None, None]
        a8, sa = jax.vmap(lambda t: _per_tensor(t, jnp.float8_e4m3fn))(x)
        b8, sb = jax.vmap(lambda t: _per_tensor(t, jnp.float8_e5m2))(w)
        f = jax.jit(lambda a, b, s, t: ffi.fp8_matmul(a, b, s, t, jnp.float32))
        out = f(*jax.device_put((a8, b8, sa, sb), gpu))
        xs = a8.astype(jnp.float32) * sa[:, None, None]
        ys = b8.astype(jnp.float32) * sb[:, None, None]
        ref = jnp.einsum("bmk,bnk->bmn", xs, ys, precision="highest")
        abs_sum = jnp.einsum("bmk,bnk->bmn", abs(xs), abs(ys), precision="highest")
        err = max_error(out, ref, abs_sum, jnp.float32)
        check(name + " vs emulation", err <= 1.0, f"error {err:.3g} of bound")
        err = max_error(out, f(*jax.device_put((a8, b8, sa, sb), cpu)), abs_sum, jnp.float32)
        check(name + " vs CPU handler", err <= 1.0, f"error {err:.3g} of bound")
    except Exception as e:
        check(name, False, f"{type(e).__name__}: {e}")


def probe_unpadded_n(gpu):
    """Whether cuBLASLt takes N % 16 != 0 when each output row stays 16-byte aligned (float32,
    N = 132): the custom call called directly, without the rhs pad the library applies.
    Informational: says whether that pad (a copy of the rhs and a slice of the output) could be
    smaller; it does not fail the run."""
    import jax
    import jax.numpy as jnp

    from jaxmx import ffi

    name = "probe: fp8 N = 132 (N % 16 = 4, output rows 16-byte aligned), no rhs pad"
    ka, kb = jax.random.split(jax.random.key(7))
    a = jax.random.normal(ka, (64, 128)).astype(jnp.float8_e4m3fn)
    b = jax.random.normal(kb, (132, 128)).astype(jnp.float8_e4m3fn)
    one = jnp.ones((), jnp.float32)
    call = jax.ffi.ffi_call(
        ffi.FP8_TARGET,
        (
            jax.ShapeDtypeStruct((64, 132), jnp.float32),
            jax.ShapeDtypeStruct((ffi.WORKSPACE_BYTES + 256,), jnp.uint8),
        ),
    )
    try:
        ffi.register_targets()
        out, _ = jax.jit(lambda a, b, s: call(a, b, s, s, fast_accum=False))(
            *jax.device_put((a, b, one), gpu)
        )
        x, y = a.astype(jnp.float32), b.astype(jnp.float32)
        ref = jnp.dot(x, y.T, precision="highest")
        err = max_error(out, ref, jnp.dot(abs(x), abs(y).T, precision="highest"), jnp.float32)
        log(f"  [INFO] {name}: accepted, error {err:.3g} of bound")
    except Exception as e:
        log(f"  [INFO] {name}: refused ({str(e).splitlines()[0][:200]})")


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
            x, w = exponent_varied(ka, (m, k)), exponent_varied(kb, (n, k))
            a, b = jax.device_put((jaxmx.quantize(x, fa), jaxmx.quantize(w, fb)), gpu)
            f = jax.jit(lambda a, b, o=out_dtype: ffi.mx_matmul(a, b, o))
            check_native_gemm(name, f, a, b, out_dtype, cpu, with_cpu=m * n * k <= 2**27)
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
    check_against_cudnn(gpu)


def check_non_tn_mx(gpu, cpu, capability, small=False, dry_run=False):
    """K-first MX operands on compute capability 10.x: passed to cuBLASLt untransposed (the
    lowered call says so), against the CPU handler and the emulation. ``dry_run``: the CPU
    stands in, with the 10.x layout choice forced."""
    import jax
    import jax.numpy as jnp

    import jaxmx
    from jaxmx import ffi
    from jaxmx._src.gemm import backends

    if capability[0] != 10:
        log(
            "== MX with K-first (non-TN) operands: skipped, cuBLASLt takes non-TN MXFP8 layouts "
            f"on compute capability 10.x only (this device: {capability[0]}.{capability[1]}, "
            "which gets the all-TN path)"
        )
        return
    log("== MX with K-first (non-TN) operands (cuBLASLt TRANSA/TRANSB other than TN)")
    choose = backends.mx_k_first_untransposed
    if dry_run:
        backends.mx_k_first_untransposed = lambda: True
    try:
        check("the 10.x layout choice passes K-first operands", backends.mx_k_first_untransposed())
        shapes = [(100, 72, 96), (128, 256, 512), (2, 300, 130, 1024)]
        if small:
            shapes = shapes[:2]
        layouts = [(True, False), (False, True), (True, True)]
        for shape in shapes:
            *batch, m, n, k = shape
            for lhs_kf, rhs_kf in layouts:
                name = f"mx K-first lhs={lhs_kf} rhs={rhs_kf} [{', '.join(map(str, shape))}]"
                try:
                    key = jax.random.key(m + n + k + 2 * lhs_kf + rhs_kf)
                    ka, kb = jax.random.split(key)
                    x = exponent_varied(ka, (*batch, m, k))
                    w = exponent_varied(kb, (*batch, n, k))

                    def operand(v, k_first):
                        if k_first:
                            return jaxmx.quantize(v.swapaxes(-1, -2), axis=v.ndim - 2)
                        return jaxmx.quantize(v)

                    a, b = jax.device_put((operand(x, lhs_kf), operand(w, rhs_kf)), gpu)
                    f = jax.jit(lambda a, b: ffi.mx_matmul(a, b, jnp.float32))
                    text = f.lower(a, b).as_text()
                    ok = f"lhs_k_first = {str(lhs_kf).lower()}" in text
                    ok = ok and f"rhs_k_first = {str(rhs_kf).lower()}" in text
                    check(name + " lowers untransposed", ok)
                    out = f(a, b)

                    def rows_k(q, k_first):
                        d = jaxmx.dequantize(q)
                        return d.swapaxes(-1, -2) if k_first else d

                    xd, wd = rows_k(a, lhs_kf), rows_k(b, rhs_kf)
                    ref = jnp.einsum("...mk,...nk->...mn", xd, wd, precision="highest")
                    abs_sum = jnp.einsum(
                        "...mk,...nk->...mn", abs(xd), abs(wd), precision="highest"
                    )
                    err = max_error(out, ref, abs_sum, jnp.float32)
                    check(name + " vs emulation", err <= 1.0, f"error {err:.3g} of bound")
                    on_cpu = jax.jit(lambda a, b: ffi.mx_matmul(a, b, jnp.float32))
                    err = max_error(out, on_cpu(*jax.device_put((a, b), cpu)), abs_sum, jnp.float32)
                    check(name + " vs CPU handler", err <= 1.0, f"error {err:.3g} of bound")
                except Exception as e:
                    check(name, False, f"{type(e).__name__}: {e}")
    finally:
        backends.mx_k_first_untransposed = choose


def check_block_fp8(gpu, cpu, capability, small=False):
    """Block FP8 (cuBLASLt VEC128_32F / BLK128x128_32F, sm_90): the DeepSeek-V3 GEMM shapes."""
    import jax
    import jax.numpy as jnp

    import jaxmx
    from jaxmx import ffi

    log("== block FP8 (cuBLASLt VEC128_32F / BLK128x128_32F)")
    tile = (128, 128)
    if capability[0] != 9:
        name = "block FP8 off compute capability 9.x reports the capability"
        a = jax.device_put(jaxmx.quantize(jnp.ones((128, 128)), "fp8_e4m3_block"), gpu)
        try:
            ffi.block_fp8_matmul(a, a).block_until_ready()
            check(name, False, "the call succeeded")
        except Exception as e:
            check(name, "compute capability 9.x" in str(e), str(e).splitlines()[0][:200])
        return
    e4, e5 = "fp8_e4m3_block", "fp8_e5m2_block"
    # (name, M, N, K, lhs format, lhs tile, rhs format, rhs tile, out dtype)
    cases = [
        ("fwd 1x128 x 128x128", 128, 128, 128, e4, None, e4, tile, jnp.bfloat16),
        ("fwd 1x128 x 128x128", 1, 256, 4096, e4, None, e4, tile, jnp.bfloat16),
        ("fwd 1x128 x 128x128", 100, 200, 384, e4, None, e4, tile, jnp.float32),
        ("dgrad 1x128 x 128x128", 257, 384, 1024, e4, None, e4, tile, jnp.float32),
        ("wgrad 1x128 x 1x128", 130, 1000, 512, e4, None, e4, None, jnp.float32),
        ("128x128 x 1x128", 256, 96, 640, e4, tile, e4, None, jnp.float16),
        ("e5m2 x e4m3 fwd", 64, 256, 256, e5, None, e4, tile, jnp.float32),
        ("fwd 1x128 x 128x128", 4096, 4096, 4096, e4, None, e4, tile, jnp.bfloat16),
    ]
    key = jax.random.key(7)
    for label, m, n, k, fa, ta, fb, tb, out_dtype in cases:
        if small and m * n * k > 2**25:
            continue
        name = f"block fp8 {label} -> {jnp.dtype(out_dtype).name} [{m}, {n}, {k}]"
        try:
            key, ka, kb = jax.random.split(key, 3)
            x, w = exponent_varied(ka, (m, k)), exponent_varied(kb, (n, k))
            a = jaxmx.quantize(x, fa, tile=ta)
            b = jaxmx.quantize(w, fb, tile=tb)
            a, b = jax.device_put((a, b), gpu)
            f = jax.jit(lambda a, b, o=out_dtype: ffi.block_fp8_matmul(a, b, o))
            check_native_gemm(name, f, a, b, out_dtype, cpu, with_cpu=m * n * k <= 2**27)
        except Exception as e:
            check(name, False, f"{type(e).__name__}: {e}")
    name = "block fp8 DEEPSEEK_FP8 dot_general forward and backward vs emulation"
    try:
        x = exponent_varied(jax.random.key(8), (256, 512))
        w = exponent_varied(jax.random.key(9), (384, 512))
        g = exponent_varied(jax.random.key(10), (256, 384))
        tn = (((1,), (1,)), ((), ()))

        def run(backend):
            recipe = jaxmx.recipes.DEEPSEEK_FP8.replace(backend=backend)
            f = jax.jit(lambda x, w: jaxmx.dot_general(x, w, tn, recipe=recipe))
            y, pullback = jax.vjp(f, *jax.device_put((x, w), gpu))
            return (y, *pullback(jax.device_put(g, gpu)))

        errors = []
        for got, want in zip(run("ffi"), run("emulate"), strict=True):
            scale = float(jnp.max(jnp.abs(want)))
            errors.append(float(jnp.max(jnp.abs(got - want))) / scale)
        check(name, max(errors) <= 2.0**-7, f"max |diff| / max |ref| {max(errors):.3g}")
    except Exception as e:
        check(name, False, f"{type(e).__name__}: {e}")


def check_fp4(gpu, cpu, capability, small=False):
    """FP4 (cuBLASLt VEC16_UE4M3 / VEC32_UE8M0 on CUDA_R_4F_E2M1, sm_100+): NVFP4 and MXFP4."""
    import jax
    import jax.numpy as jnp

    import jaxmx
    from jaxmx import ffi

    log("== FP4 (cuBLASLt VEC16_UE4M3 / VEC32_UE8M0 on CUDA_R_4F_E2M1)")
    try:
        a4, b4 = (
            jaxmx.quantize(jnp.ones((4, 64)), "nvfp4"),
            jaxmx.quantize(jnp.ones((4, 64)), "mxfp4"),
        )
        ffi.fp4_matmul(a4, b4)
        check("fp4 nvfp4 x mxfp4 is refused", False, "it ran")
    except NotImplementedError as e:
        check("fp4 nvfp4 x mxfp4 is refused", "two MXFP4 or two NVFP4" in str(e), str(e)[:200])
    if capability < (10, 0):
        for fmt in ("nvfp4", "mxfp4"):
            name = f"fp4 {fmt} on cc < 10.0 fails cleanly with the capability error"
            a = jax.device_put(jaxmx.quantize(jnp.ones((128, 64)), fmt), gpu)
            try:
                ffi.fp4_matmul(a, a).block_until_ready()
                check(name, False, "the call succeeded")
            except Exception as e:
                msg = str(e)
                ok = "compute capability" in msg and "10.0" in msg
                log(f"  {fmt}: not supported on this device ({msg.splitlines()[0][:160]})")
                check(name, ok, msg.splitlines()[0][:200])
        return
    # (format, M, N, K, out dtype): M = 1, M and N off multiples of 128, K off multiples of 32
    cases = [
        ("nvfp4", 128, 128, 128, jnp.bfloat16),
        ("nvfp4", 1, 256, 4096, jnp.bfloat16),
        ("nvfp4", 100, 200, 80, jnp.float32),
        ("nvfp4", 257, 130, 1000, jnp.float16),
        ("mxfp4", 128, 128, 128, jnp.float32),
        ("mxfp4", 1, 256, 4096, jnp.bfloat16),
        ("mxfp4", 100, 200, 96, jnp.float16),
        ("mxfp4", 257, 130, 1000, jnp.float32),
        ("nvfp4", 4096, 4096, 4096, jnp.bfloat16),
        ("mxfp4", 4096, 4096, 4096, jnp.bfloat16),
    ]
    key = jax.random.key(11)
    for fmt, m, n, k, out_dtype in cases:
        if small and m * n * k > 2**25:
            continue
        name = f"fp4 {fmt} -> {jnp.dtype(out_dtype).name} [{m}, {n}, {k}]"
        try:
            key, ka, kb = jax.random.split(key, 3)
            x, w = exponent_varied(ka, (m, k)), exponent_varied(kb, (n, k))
            a, b = jax.device_put((jaxmx.quantize(x, fmt), jaxmx.quantize(w, fmt)), gpu)
            f = jax.jit(lambda a, b, o=out_dtype: ffi.fp4_matmul(a, b, o))
            check_native_gemm(name, f, a, b, out_dtype, cpu, with_cpu=m * n * k <= 2**27)
        except Exception as e:
            check(name, False, f"{type(e).__name__}: {e}")
    for fmt in ("nvfp4", "mxfp4"):
        name = f"fp4 {fmt} batch dims and vmap (a tensor scale per element) vs CPU handler"
        try:
            x = exponent_varied(jax.random.key(12), (3, 100, 256))
            w = exponent_varied(jax.random.key(13), (3, 72, 256))
            quantize = jax.vmap(lambda t, fmt=fmt: jaxmx.quantize(t, fmt))
            a, b = quantize(x), quantize(w)
            whole = jaxmx.quantize(x, fmt), jaxmx.quantize(w, fmt)  # one tensor scale each

            def gemms(a, b, whole):
                mm = jax.jit(lambda a, b: ffi.fp4_matmul(a, b, jnp.float32))
                vmapped = jax.jit(jax.vmap(lambda a, b: ffi.fp4_matmul(a, b, jnp.float32)))
                return mm(*whole), vmapped(a, b)

            got = gemms(*jax.device_put((a, b, whole), gpu))
            want = gemms(*jax.device_put((a, b, whole), cpu))
            dequantize = jax.vmap(jaxmx.dequantize)
            abs_sums = [
                jnp.einsum("bmk,bnk->bmn", abs(xd), abs(wd))
                for xd, wd in [
                    (jaxmx.dequantize(whole[0]), jaxmx.dequantize(whole[1])),
                    (dequantize(a), dequantize(b)),
                ]
            ]
            err = max(
                max_error(g, c, t, jnp.float32) for g, c, t in zip(got, want, abs_sums, strict=True)
            )
            check(name, err <= 1.0, f"error {err:.3g} of bound")
        except Exception as e:
            check(name, False, f"{type(e).__name__}: {e}")


def exponent_varied(key, shape):
    """Normal data times 2^e, e varying per row (-8..2) and per 32-element block (-3..1): scales
    differ across rows and blocks, and float16 results stay finite."""
    import jax
    import jax.numpy as jnp

    k1, k2, k3 = jax.random.split(key, 3)
    blocks = -(-shape[-1] // 32)
    row = jax.random.randint(k2, (*shape[:-1], 1), -8, 3)
    block = jax.random.randint(k3, (*shape[:-1], blocks), -3, 2)
    e = row + jnp.repeat(block, 32, axis=-1)[..., : shape[-1]]
    return jax.random.normal(k1, shape) * jnp.exp2(e.astype(jnp.float32))


def check_against_cudnn(gpu):
    """The MX GEMM against jax.nn.scaled_matmul (cuDNN's block-scaled GEMM), same operands."""
    import jax
    import jax.numpy as jnp

    import jaxmx
    from jaxmx import ffi

    name = "mx vs jax.nn.scaled_matmul (cuDNN) [2, 256, 384, 512]"
    if gpu.platform != "gpu":
        log(f"  [SKIP] {name}: cuDNN only (no CPU lowering)")
        return
    try:
        ka, kb = jax.random.split(jax.random.key(6))
        a = jaxmx.quantize(exponent_varied(ka, (2, 256, 512)))
        b = jaxmx.quantize(exponent_varied(kb, (2, 384, 512)), "mxfp8_e5m2")
        a, b = jax.device_put((a, b), gpu)
        ours = jax.jit(lambda a, b: ffi.mx_matmul(a, b, jnp.float32))(a, b)
        cudnn = jax.jit(
            lambda a, b: jax.nn.scaled_matmul(
                a.data, b.data, a.scale, b.scale, preferred_element_type=jnp.float32
            )
        )(a, b)
        xd, wd = jaxmx.dequantize(a), jaxmx.dequantize(b)
        abs_sum = jnp.einsum("bmk,bnk->bmn", abs(xd), abs(wd), precision="highest")
        err = max_error(ours, cudnn, abs_sum, jnp.float32)
        check(name, err <= 1.0, f"error {err:.3g} of bound")
    except Exception as e:
        check(name, False, f"{type(e).__name__}: {e}")


def check_devices(gpus, cpu):
    """On a host with several GPUs, the per-tensor GEMM on each (one cuBLASLt handle per device,
    created with that device current), against the CPU handler."""
    import jax
    import jax.numpy as jnp

    from jaxmx import ffi

    if len(gpus) < 2:
        return
    name = "fp8 on every device"
    try:
        ka, kb = jax.random.split(jax.random.key(8))
        a8, sa = _per_tensor(jax.random.normal(ka, (128, 256)), jnp.float8_e4m3fn)
        b8, sb = _per_tensor(jax.random.normal(kb, (96, 256)), jnp.float8_e4m3fn)
        f = jax.jit(lambda a, b, s, t: ffi.fp8_matmul(a, b, s, t, jnp.float32))
        expected = f(*jax.device_put((a8, b8, sa, sb), cpu))
        xs, ys = a8.astype(jnp.float32) * sa, b8.astype(jnp.float32) * sb
        abs_sum = jnp.dot(abs(xs), abs(ys).T, precision="highest")
        errors = []
        for d in reversed(gpus):  # the last device first: not the default one
            out = f(*jax.device_put((a8, b8, sa, sb), d))
            errors.append(max_error(out, expected, abs_sum, jnp.float32))
        check(f"{name} ({len(gpus)} GPUs)", max(errors) <= 1.0, f"errors {errors} of bound")
    except Exception as e:
        check(name, False, f"{type(e).__name__}: {e}")


# --- CUDA graphs --------------------------------------------------------------------------------

GRAPH_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    import jaxmx
    from jaxmx import ffi

    def bound_error(out, xd, wd):
        ref = jnp.einsum("...mk,...nk->...mn", xd, wd, precision="highest")
        abs_sum = jnp.einsum("...mk,...nk->...mn", abs(xd), abs(wd), precision="highest")
        return float(jnp.max(jnp.abs(out - ref) / (2.0**-12 * abs_sum + 1e-30)))

    mx = sys.argv[1] == "mx"
    f = jax.jit(lambda a, b: 2.0 * (ffi.mx_matmul(a, b, jnp.float32) if mx else
                                    ffi.fp8_matmul(a, b, 0.5, 1.0, jnp.float32)) + 1.0)
    for shape in ((2, 136, 72, 160), (1, 520, 264, 96)):
        for run in range(2):  # the second run replays (or updates) the recorded graph
            ka, kb = jax.random.split(jax.random.key(10 * run + shape[1]))
            x = jax.random.normal(ka, (*shape[:2], shape[3]))
            w = jax.random.normal(kb, (shape[0], shape[2], shape[3]))
            if mx:
                a, b = jaxmx.quantize(x), jaxmx.quantize(w)
                xd, wd = jaxmx.dequantize(a), jaxmx.dequantize(b)
            else:
                a, b = x.astype(jnp.float8_e4m3fn), w.astype(jnp.float8_e4m3fn)
                xd, wd = 0.5 * a.astype(jnp.float32), b.astype(jnp.float32)
            out = (f(a, b) - 1.0) / 2.0
            text = f.lower(a, b).compile().as_text()
            print(shape, run, bound_error(out, xd, wd), "command_buffer" in text, flush=True)
    """
)


def check_graphs(capability, platform: str):
    """The GEMMs captured into CUDA graphs: a fresh process with command buffers enabled for
    custom calls (XLA flags must be set before JAX starts), new shapes, two runs each."""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + GRAPH_FLAGS))
    env["JAX_PLATFORMS"] = "cuda" if platform == "gpu" else "cpu"
    log(f"== CUDA graphs (XLA_FLAGS {GRAPH_FLAGS})")
    kinds = (["fp8"] if capability >= (8, 9) else []) + (["mx"] if capability >= (10, 0) else [])
    for kind in kinds:
        name = f"{kind} GEMM in a command buffer"
        try:
            run = subprocess.run(
                [sys.executable, "-c", GRAPH_SCRIPT, kind],
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
            )
            if run.returncode != 0:
                check(name, False, run.stderr.strip().splitlines()[-1][:300])
                continue
            for line in run.stdout.strip().splitlines():
                *what, err, captured = line.rsplit(" ", 2)
                ok = float(err) <= 1.0 and (captured == "True" or platform != "gpu")
                check(f"{name} {' '.join(what)}", ok, f"error {float(err):.3g} of bound, "
                      f"{'in' if captured == 'True' else 'NOT in'} a command buffer")  # fmt: skip
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
        for fast_accum in (False, True):
            fp8 = jax.jit(
                lambda a, b, s, t, f=fast_accum: ffi.fp8_matmul(
                    a, b, s, t, jnp.bfloat16, fast_accum=f
                )
            )
            label = "fp8 per-tensor (cuBLASLt)" + (", fast accumulation" if fast_accum else "")
            rows.append((label, bench(fp8, a8, b8, sa, sb, iters=iters)))
            xs, ws = a8.astype(jnp.float32) * sa, b8.astype(jnp.float32) * sb
            check_speed_output(label, fp8(a8, b8, sa, sb), xs, ws)
    except Exception as e:
        check("fp8 per-tensor speed run", False, f"{type(e).__name__}: {e}")
    if capability >= (10, 0):
        try:
            a, b = jaxmx.quantize(x), jaxmx.quantize(w)
            xd, wd = jaxmx.dequantize(a), jaxmx.dequantize(b)
            mx = jax.jit(lambda a, b: ffi.mx_matmul(a, b, jnp.bfloat16))
            rows.append(("mxfp8 (cuBLASLt), pre-quantized", bench(mx, a, b, iters=iters)))
            check_speed_output(rows[-1][0], mx(a, b), xd, wd)
            mxq = jax.jit(lambda x, w: ffi.mx_matmul(jaxmx.quantize(x), jaxmx.quantize(w)))
            rows.append(("mxfp8 (cuBLASLt), quantize included", bench(mxq, x, w, iters=iters)))
            check_speed_output(rows[-1][0], mxq(x, w), xd, wd)
        except Exception as e:
            check("mxfp8 speed run", False, f"{type(e).__name__}: {e}")
    for name, t in rows:
        rate = flops / t / 1e12
        log(f"  {name:38s} {t * 1e3:8.3f} ms  {rate:8.1f} TFLOP/s  {bf16 / t:5.2f}x bf16")


def check_speed_output(label: str, out, xd, wd) -> None:
    """The output of a timed GEMM against the float32 GEMM of its dequantized operands."""
    import jax.numpy as jnp

    ref = jnp.dot(xd, wd.T, precision="highest", preferred_element_type=jnp.float32)
    abs_sum = jnp.dot(abs(xd), abs(wd).T, precision="highest", preferred_element_type=jnp.float32)
    err = max_error(out, ref, abs_sum, out.dtype)
    check(f"speed run output: {label}", err <= 1.0, f"error {err:.3g} of bound")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--install", action="store_true", help="build + install jaxmx here first (no network)"
    )
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

    start = time.perf_counter()
    gpus = report()
    if args.cpu_dry_run:
        cpu = jax.devices("cpu")[0]
        log("== CPU dry run: the CPU handler stands in for cuBLASLt, as if compute capability 10.0")
        check_fp8(cpu, cpu, (10, 0))
        check_mx(cpu, cpu, (10, 0), small=True)
        check_non_tn_mx(cpu, cpu, (10, 0), small=True, dry_run=True)
        check_block_fp8(cpu, cpu, (9, 0), small=True)
        check_fp4(cpu, cpu, (10, 0), small=True)
        check_graphs((10, 0), "cpu")
        if not args.skip_speed:
            speed(cpu, (10, 0), args.size, args.iters)
        return finish(start)
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
    steps = [lambda: check_fp8(gpu, cpu, cc), lambda: check_mx(gpu, cpu, cc)]
    steps.append(lambda: check_non_tn_mx(gpu, cpu, cc))
    steps.append(lambda: check_block_fp8(gpu, cpu, cc))
    steps.append(lambda: check_fp4(gpu, cpu, cc))
    steps.append(lambda: check_graphs(cc, "gpu"))
    if cc >= (8, 9):
        steps.append(lambda: check_devices(gpus, cpu))
    for step in steps:
        try:
            step()
        except Exception:
            traceback.print_exc()
            FAILURES.append("unexpected exception")
    if not args.skip_speed:
        speed(gpu, cc, args.size, args.iters)
    return finish(start)


def finish(start: float) -> int:
    """Prints the run time (checked against the 5-minute budget) and the result."""
    seconds = time.perf_counter() - start
    check(f"run time {seconds:.0f} s", seconds <= TIME_BUDGET_S, f"budget {TIME_BUDGET_S} s")
    log("== result: " + ("all checks passed" if not FAILURES else f"FAILED: {FAILURES}"))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
