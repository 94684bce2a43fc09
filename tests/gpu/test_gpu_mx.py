"""MXFP8 (``jaxmx.ffi.mx_matmul``, cuBLASLt VEC32_UE8M0) on a CUDA device, against
``jaxmx.dequantize`` + float32 ``jnp.dot`` at HIGHEST, the CPU handler and cuDNN's block-scaled
GEMM (``jax.nn.scaled_matmul``); K-first (non-TN) operands where cuBLASLt takes them untransposed;
the capability error where the device has no MX GEMM."""

import jax
import jax.numpy as jnp
import pytest
from gpu_helpers import (
    DRY_RUN,
    assert_refused,
    assert_within_bound,
    check_native_gemm,
    emulation,
    exponent_varied,
    require,
    skip_large_in_dry_run,
)

import jaxmx
from jaxmx import ffi
from jaxmx._src.gemm import capabilities

pytestmark = pytest.mark.gpu

E4, E5 = "mxfp8_e4m3", "mxfp8_e5m2"
SHAPES = [(128, 128, 128), (1, 256, 4096), (100, 200, 96), (257, 130, 1000)]
COMBOS = [(E4, E4, jnp.bfloat16), (E4, E5, jnp.float32), (E5, E4, jnp.float16)]  # no E5M2 x E5M2
CASES = [(s, c) for s in SHAPES for c in COMBOS] + [((2048, 2048, 2048), COMBOS[0])]


def _mx(out_dtype):
    return jax.jit(lambda a, b: ffi.mx_matmul(a, b, out_dtype))


def _case_id(case):
    (m, n, k), (fa, fb, out_dtype) = case
    return f"{m}x{n}x{k}-{fa}-{fb}-{jnp.dtype(out_dtype).name}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_mx_matches_the_emulation_and_the_cpu_handler(gpu, cpu, case):
    """Exponents varying per row and per 32-block on both sides; M = 1, M / N off multiples of
    128, K padded to a multiple of 32; every output dtype."""
    require("mx")
    (m, n, k), (fa, fb, out_dtype) = case
    skip_large_in_dry_run(m, n, k)
    ka, kb = jax.random.split(jax.random.key(m + n + k))
    a = jaxmx.quantize(exponent_varied(ka, (m, k)), fa)
    b = jaxmx.quantize(exponent_varied(kb, (n, k)), fb)
    check_native_gemm(_mx(out_dtype), a, b, out_dtype, gpu, cpu)


def test_mx_batch_dims_and_vmap(gpu):
    """One strided-batched cuBLASLt call, the scale tensors one after the other."""
    require("mx")
    x = jax.random.normal(jax.random.key(2), (3, 100, 256))
    w = jax.random.normal(jax.random.key(3), (3, 72, 256))
    a, b = jax.device_put((jaxmx.quantize(x), jaxmx.quantize(w)), gpu)
    ref, abs_sum = emulation(jaxmx.dequantize(a), jaxmx.dequantize(b))
    batched = _mx(jnp.float32)(a, b)
    vmapped = jax.jit(jax.vmap(lambda a, b: ffi.mx_matmul(a, b, jnp.float32)))(a, b)
    assert_within_bound(batched, ref, abs_sum, jnp.float32, "batch dims")
    assert_within_bound(vmapped, ref, abs_sum, jnp.float32, "vmap")


def test_mx_agrees_with_cudnn_scaled_matmul(gpu):
    require("mx")
    if gpu.platform != "gpu":
        pytest.skip("jax.nn.scaled_matmul runs on cuDNN only (no CPU lowering)")
    ka, kb = jax.random.split(jax.random.key(6))
    a = jaxmx.quantize(exponent_varied(ka, (2, 256, 512)))
    b = jaxmx.quantize(exponent_varied(kb, (2, 384, 512)), E5)
    a, b = jax.device_put((a, b), gpu)
    ours = _mx(jnp.float32)(a, b)
    cudnn = jax.jit(
        lambda a, b: jax.nn.scaled_matmul(
            a.data, b.data, a.scale, b.scale, preferred_element_type=jnp.float32
        )
    )(a, b)
    _, abs_sum = emulation(jaxmx.dequantize(a), jaxmx.dequantize(b))
    assert_within_bound(ours, cudnn, abs_sum, jnp.float32, "vs cuDNN")


def test_mx_e5m2_x_e5m2_is_refused():
    """cuBLASLt's FP8 type table has no E5M2 x E5M2; jaxmx refuses it before any call."""
    e5 = jaxmx.quantize(jnp.ones((4, 64)), E5)
    with pytest.raises(NotImplementedError, match="E5M2 x E4M3"):
        ffi.mx_matmul(e5, e5)


def test_mx_below_its_compute_capability_is_refused(gpu):
    a = jax.device_put(jaxmx.quantize(jnp.ones((128, 64))), gpu)
    assert_refused("mx", gpu, lambda: ffi.mx_matmul(a, a))


@pytest.fixture
def k_first_device(gpu):
    """Skips unless the MX GEMM takes K-first operands untransposed on this device
    (:attr:`jaxmx._src.gemm.capabilities.Capabilities.non_tn_mx`); in a dry run the CPU stands
    in, traced as if on a 10.0 device with cuBLASLt 12.8."""
    here = capabilities.probe()
    if DRY_RUN:
        blackwell = capabilities.Capabilities(compute_capability=(10, 0), cublaslt_version=120800)
        with capabilities.assume(blackwell):
            yield gpu
        return
    if not here.non_tn_mx:
        pytest.skip(
            f"the MX GEMM transposes K-first operands to TN form on this device (compute "
            f"capability {here.compute_capability}, MX: {here.status('mx')}): cuBLASLt's non-TN "
            "MXFP8 layouts are not used here (Capabilities.non_tn_mx)"
        )
    yield gpu


def _operand(v, k_first: bool):
    """An MXArray of ``v`` ([..., rows, K]), stored K-first ([..., K, rows]) if asked."""
    if k_first:
        return jaxmx.quantize(v.swapaxes(-1, -2), axis=v.ndim - 2)
    return jaxmx.quantize(v)


def _rows_k(q, k_first: bool):
    d = jaxmx.dequantize(q)
    return d.swapaxes(-1, -2) if k_first else d


@pytest.mark.parametrize("shape", [(100, 72, 96), (128, 256, 512), (2, 300, 130, 1024)])
@pytest.mark.parametrize("lhs_k_first, rhs_k_first", [(True, False), (False, True), (True, True)])
def test_mx_k_first_operands_go_untransposed(k_first_device, cpu, shape, lhs_k_first, rhs_k_first):
    *batch, m, n, k = shape
    ka, kb = jax.random.split(jax.random.key(m + n + k + 2 * lhs_k_first + rhs_k_first))
    a = _operand(exponent_varied(ka, (*batch, m, k)), lhs_k_first)
    b = _operand(exponent_varied(kb, (*batch, n, k)), rhs_k_first)
    a, b = jax.device_put((a, b), k_first_device)
    f = _mx(jnp.float32)
    text = f.lower(a, b).as_text()
    assert f"lhs_k_first = {str(lhs_k_first).lower()}" in text
    assert f"rhs_k_first = {str(rhs_k_first).lower()}" in text
    out = f(a, b)
    ref, abs_sum = emulation(_rows_k(a, lhs_k_first), _rows_k(b, rhs_k_first))
    assert_within_bound(out, ref, abs_sum, jnp.float32, "vs emulation")
    on_cpu = f(*jax.device_put((a, b), cpu))
    assert_within_bound(out, on_cpu, abs_sum, jnp.float32, "vs CPU handler")


def test_mx_and_fp8_of_one_shape_in_one_process(gpu):
    """Per-tensor FP8 and MX GEMMs of one shape, one after the other in this process: on the
    cuBLASLt versions that share heuristic results between them, the MX descriptor's dummy
    ALPHA_VECTOR_BATCH_STRIDE keeps their plans apart (a shared one would be wrong for one)."""
    require("fp8")
    require("mx")
    kx, kw = jax.random.split(jax.random.key(14))
    x, w = jax.random.normal(kx, (512, 256)), jax.random.normal(kw, (384, 256))
    a8, b8 = x.astype(jnp.float8_e4m3fn), w.astype(jnp.float8_e4m3fn)
    one = jnp.ones((), jnp.float32)
    fp8 = jax.jit(lambda a, b, s: ffi.fp8_matmul(a, b, s, s, jnp.bfloat16))
    a, b = jaxmx.quantize(x), jaxmx.quantize(w)
    for _ in range(2):  # fp8, mx, then both again (plans cached by then)
        out = fp8(*jax.device_put((a8, b8, one), gpu))
        ref, abs_sum = emulation(a8.astype(jnp.float32), b8.astype(jnp.float32))
        assert_within_bound(out, ref, abs_sum, jnp.bfloat16, "fp8")
        qa, qb = jax.device_put((a, b), gpu)
        ref, abs_sum = emulation(jaxmx.dequantize(qa), jaxmx.dequantize(qb))
        assert_within_bound(_mx(jnp.bfloat16)(qa, qb), ref, abs_sum, jnp.bfloat16, "mx")
