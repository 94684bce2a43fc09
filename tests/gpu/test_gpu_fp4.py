"""FP4 (``jaxmx.ffi.fp4_matmul``: NVFP4 VEC16_UE4M3 and MXFP4 VEC32_UE8M0 on packed E2M1) on a
CUDA device, against ``jaxmx.dequantize`` + float32 ``jnp.dot`` and the CPU handler; the
capability error where the device has no FP4 GEMM."""

import jax
import jax.numpy as jnp
import pytest
from gpu_helpers import (
    assert_refused,
    assert_within_bound,
    check_native_gemm,
    exponent_varied,
    require,
    skip_large_in_dry_run,
)

import jaxmx
from jaxmx import ffi

pytestmark = pytest.mark.gpu

CASES = [  # (format, M, N, K, out dtype): M = 1, M / N off multiples of 128, K padded
    ("nvfp4", 128, 128, 128, jnp.bfloat16),
    ("nvfp4", 1, 256, 4096, jnp.bfloat16),
    ("nvfp4", 100, 200, 80, jnp.float32),
    ("nvfp4", 257, 130, 1000, jnp.float16),
    ("mxfp4", 128, 128, 128, jnp.float32),
    ("mxfp4", 1, 256, 4096, jnp.bfloat16),
    ("mxfp4", 100, 200, 96, jnp.float16),
    ("mxfp4", 257, 130, 1000, jnp.float32),
    ("nvfp4", 2048, 2048, 2048, jnp.bfloat16),
    ("mxfp4", 2048, 2048, 2048, jnp.bfloat16),
]
FORMATS = ("nvfp4", "mxfp4")


def _fp4(out_dtype):
    return jax.jit(lambda a, b: ffi.fp4_matmul(a, b, out_dtype))


def _case_id(case):
    fmt, m, n, k, out_dtype = case
    return f"{fmt}-{m}x{n}x{k}-{jnp.dtype(out_dtype).name}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp4_matches_the_emulation_and_the_cpu_handler(gpu, cpu, case):
    require("fp4")
    fmt, m, n, k, out_dtype = case
    skip_large_in_dry_run(m, n, k)
    ka, kb = jax.random.split(jax.random.key(m + n + k))
    a = jaxmx.quantize(exponent_varied(ka, (m, k)), fmt)
    b = jaxmx.quantize(exponent_varied(kb, (n, k)), fmt)
    check_native_gemm(_fp4(out_dtype), a, b, out_dtype, gpu, cpu)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp4_batch_dims_and_vmap_match_the_cpu_handler(gpu, cpu, fmt):
    """Batch dims with one tensor scale for the whole operand, and vmap with one per element
    (one cuBLASLt call per batch element, each with its alpha)."""
    require("fp4")
    x = exponent_varied(jax.random.key(12), (3, 100, 256))
    w = exponent_varied(jax.random.key(13), (3, 72, 256))
    per_element = jax.vmap(lambda t: jaxmx.quantize(t, fmt))
    a, b = per_element(x), per_element(w)
    whole = jaxmx.quantize(x, fmt), jaxmx.quantize(w, fmt)
    vmapped = jax.jit(jax.vmap(lambda a, b: ffi.fp4_matmul(a, b, jnp.float32)))

    def gemms(device):
        (a_, b_), (wa, wb) = jax.device_put(((a, b), whole), device)
        return _fp4(jnp.float32)(wa, wb), vmapped(a_, b_)

    dequantize = jax.vmap(jaxmx.dequantize)
    operands = [
        (jaxmx.dequantize(whole[0]), jaxmx.dequantize(whole[1])),
        (dequantize(a), dequantize(b)),
    ]
    for what, got, want, (xd, wd) in zip(
        ("batch dims", "vmap"), gemms(gpu), gemms(cpu), operands, strict=True
    ):
        abs_sum = jnp.einsum("bmk,bnk->bmn", abs(xd), abs(wd))
        assert_within_bound(got, want, abs_sum, jnp.float32, f"{what} vs CPU handler")


def test_fp4_nvfp4_x_mxfp4_is_refused():
    a, b = (jaxmx.quantize(jnp.ones((4, 64)), fmt) for fmt in FORMATS)
    with pytest.raises(NotImplementedError, match="two MXFP4 or two NVFP4"):
        ffi.fp4_matmul(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp4_below_its_compute_capability_is_refused(gpu, fmt):
    a = jax.device_put(jaxmx.quantize(jnp.ones((128, 64)), fmt), gpu)
    assert_refused("fp4", gpu, lambda: ffi.fp4_matmul(a, a))
