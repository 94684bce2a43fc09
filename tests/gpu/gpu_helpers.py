"""Shared pieces of the GPU tests (tests/gpu): the error bound, operand generators, and the
capability gates, which take their thresholds from jaxmx._src.gemm.capabilities (REQUIREMENTS,
the one place that knows them).

The reference of every check is independent of cuBLASLt: the operands decoded
(``jaxmx.dequantize``, or FP8 codes times their scales) and multiplied by ``jnp.dot`` in float32
at HIGHEST precision, and the same call on the extension's C++ CPU handler.

``JAXMX_GPU_DRY_RUN=1`` runs the suite with the CPU standing in for the GPU (the CPU handler in
place of cuBLASLt, every family taken as available): it tests these tests, not CUDA.

Example:
    >>> import numpy as np
    >>> bound_fraction(np.ones(2), np.ones(2), np.ones(2), np.float32)
    0.0
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmx
from jaxmx._src.gemm import capabilities

DRY_RUN = os.environ.get("JAXMX_GPU_DRY_RUN", "") == "1"
OUT_DTYPES = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}  # eps_out
OUT_TINY = {"float32": 2.0**-150, "bfloat16": 2.0**-134, "float16": 2.0**-25}  # half subnormal
LARGE = 2**27  # M * N * K above which the CPU handler is not run (seconds per call there)
ACCUMULATION = 2.0**-10
"""The native GEMMs' accumulation bound, per entry a fraction of ``sum_k |a_k b_k|``: Hopper's
FP8 tensor cores keep about 14 bits in their partial sums (DeepSeek-V3 technical report,
section 3.3.2). On an H200 (cuBLASLt 13) per-tensor and block FP8 reached 2.6 times
``2^-12`` (docs/native.md)."""
HOPPER_FAILURES = {
    "scale_overflow": "cuBLASLt's block-FP8 GEMM gave inf where a partial sum times one "
    "operand's scale (3e35) passes float32's range and the exact result is finite, on an H200",
}
"""What the first run on a Hopper GPU (an H200, 2026-12-04) showed the native GEMMs not to do;
the tests expect these failures there (strict xfail: a fix shows as XPASS). docs/native.md."""


def bound_fraction(out, ref, abs_sum, out_dtype, roundings: int = 1) -> float:
    """Worst ``|out - ref|`` in units of ``roundings * (eps_out * |ref| + tiny_out) +
    ACCUMULATION * sum|products|`` (the tensor cores' accumulation over K plus ``roundings``
    roundings to the output type: 1 against a float32 reference, 2 against another result
    rounded to the output type); <= 1 passes."""
    name = str(np.dtype(out_dtype))
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    bound = roundings * (OUT_DTYPES[name] * np.abs(ref) + OUT_TINY[name])
    bound = bound + ACCUMULATION * np.asarray(abs_sum, np.float64)
    return float(np.max(np.abs(out - ref) / bound, initial=0.0))


def assert_within_bound(out, ref, abs_sum, out_dtype, what: str, roundings: int = 1) -> None:
    err = bound_fraction(out, ref, abs_sum, out_dtype, roundings)
    assert err <= 1.0, f"{what}: error {err:.3g} of the bound"


def emulation(xd, wd):
    """(float32 GEMM of the decoded operands ``[..., M, K] x [..., N, K]``, sum of |products|)."""
    dot = "...mk,...nk->...mn"
    ref = jnp.einsum(dot, xd, wd, precision="highest", preferred_element_type=jnp.float32)
    abs_sum = jnp.einsum(dot, abs(xd), abs(wd), precision="highest")
    return ref, abs_sum


def check_native_gemm(f, a, b, out_dtype, gpu, cpu) -> None:
    """``f(a, b)`` (a jitted native GEMM of two MXArrays) on ``gpu`` against the emulation and,
    below :data:`LARGE`, against the same call on the CPU handler."""
    a, b = jax.device_put((a, b), gpu)
    out = f(a, b)
    ref, abs_sum = emulation(jaxmx.dequantize(a), jaxmx.dequantize(b))
    assert_within_bound(out, ref, abs_sum, out_dtype, "vs emulation")
    m, k = a.shape[-2:]
    if m * b.shape[-2] * k <= LARGE:
        on_cpu = f(*jax.device_put((a, b), cpu))
        assert_within_bound(out, on_cpu, abs_sum, out_dtype, "vs CPU handler", roundings=2)


def per_tensor(x, dtype):
    """(FP8 codes, float32 scale) of ``x`` with one scale for the tensor (amax -> max code)."""
    elem_max = float(jnp.finfo(dtype).max)
    scale = jnp.max(jnp.abs(x)) / elem_max
    codes = jnp.clip(x / scale, -elem_max, elem_max).astype(dtype)
    return codes, scale.astype(jnp.float32)


def exponent_varied(key, shape):
    """Normal data times 2^e, e varying per row (-8..2) and per 32-element block (-3..1): scales
    differ across rows and blocks, and float16 results stay finite."""
    k1, k2, k3 = jax.random.split(key, 3)
    blocks = -(-shape[-1] // 32)
    row = jax.random.randint(k2, (*shape[:-1], 1), -8, 3)
    block = jax.random.randint(k3, (*shape[:-1], blocks), -3, 2)
    e = row + jnp.repeat(block, 32, axis=-1)[..., : shape[-1]]
    return jax.random.normal(k1, shape) * jnp.exp2(e.astype(jnp.float32))


def require(family: str) -> None:
    """Skips the test unless cuBLASLt runs the native GEMM of ``family`` (``"fp8"``, ``"mx"``,
    ``"block_fp8"``, ``"fp4"``) on this device, with the reason as the skip message."""
    if DRY_RUN:
        return
    status = capabilities.probe().status(family)
    if status != "available":
        pytest.skip(f"{family} GEMM: {status}")


def expect_hopper_failure(request, what: str) -> None:
    """Marks the running test as expected to fail (strictly) on a Hopper GPU, for the reason
    :data:`HOPPER_FAILURES` gives ``what``; nothing elsewhere (nor in a dry run)."""
    if DRY_RUN:
        return
    cc = capabilities.probe().compute_capability
    if cc is not None and cc[0] == 9:
        request.applymarker(pytest.mark.xfail(strict=True, reason=HOPPER_FAILURES[what]))


def skip_large_in_dry_run(m: int, n: int, k: int) -> None:
    if DRY_RUN and m * n * k > LARGE:
        pytest.skip("dry run: a large shape, for a GPU only")


def assert_refused(family: str, gpu, call) -> None:
    """Where this device cannot run ``family``: ``call()`` fails with the handler's error naming
    what the status names (the device's compute capability, or the loaded cuBLASLt's version).
    Skips where it can (nothing to refuse) and in a dry run."""
    if DRY_RUN:
        pytest.skip("dry run: the CPU handler refuses nothing by compute capability")
    status = capabilities.probe().status(family)
    if status == "available":
        pytest.skip(f"{family} GEMM runs on this device: nothing is refused")
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.block_until_ready(call())
    message = str(info.value)
    if "compute capability" in status:
        major, minor = capabilities.compute_capability(gpu)
        assert f"has compute capability {major}.{minor};" in message, message
        assert "needs compute capability" in message or "runs on compute capability" in message
    else:
        assert "is loaded" in message and "needs CUDA/cuBLASLt" in message, message
