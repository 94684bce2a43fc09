"""Per-tensor FP8 (``jaxmx.ffi.fp8_matmul``, cuBLASLt SCALAR_32F) on a CUDA device, against the
emulation (codes times scales, float32 ``jnp.dot`` at HIGHEST) and the CPU handler; the
per-tensor and per-row FP8 formats and their recipes (FP8_TENSORWISE, FP8_ROWWISE) on it."""

import jax
import jax.numpy as jnp
import pytest
from gpu_helpers import (
    DRY_RUN,
    LARGE,
    assert_refused,
    assert_within_bound,
    check_native_gemm,
    emulation,
    exponent_varied,
    per_tensor,
    require,
    skip_large_in_dry_run,
)

import jaxmx
from jaxmx import ffi

pytestmark = pytest.mark.gpu

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
CASES = [  # (M, N, K), (lhs dtype, rhs dtype, out dtype): odd shapes, E4M3 / E5M2 mixes
    ((128, 256, 512), (E4, E4, jnp.bfloat16)),
    ((1, 4096, 1024), (E4, E5, jnp.float32)),
    ((300, 200, 96), (E5, E4, jnp.float16)),
    ((333, 77, 160), (E4, E4, jnp.float32)),
    ((2048, 2048, 2048), (E4, E4, jnp.bfloat16)),
]


def _fp8(out_dtype, fast_accum=False):
    return jax.jit(lambda a, b, s, t: ffi.fp8_matmul(a, b, s, t, out_dtype, fast_accum=fast_accum))


def _case_id(case):
    (m, n, k), dtypes = case
    return f"{m}x{n}x{k}-" + "-".join(jnp.dtype(d).name for d in dtypes)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("fast_accum", [False, True], ids=["accum", "fast_accum"])
def test_fp8_matches_the_emulation_and_the_cpu_handler(gpu, cpu, case, fast_accum):
    require("fp8")
    (m, n, k), (ta, tb, out_dtype) = case
    skip_large_in_dry_run(m, n, k)
    ka, kb = jax.random.split(jax.random.key(m + n + k))
    a8, sa = per_tensor(jax.random.normal(ka, (m, k)), ta)
    b8, sb = per_tensor(jax.random.normal(kb, (n, k)), tb)
    f = _fp8(out_dtype, fast_accum)
    out = f(*jax.device_put((a8, b8, sa, sb), gpu))
    ref, abs_sum = emulation(a8.astype(jnp.float32) * sa, b8.astype(jnp.float32) * sb)
    assert_within_bound(out, ref, abs_sum, out_dtype, "vs emulation")
    if m * n * k <= LARGE:
        out_cpu = f(*jax.device_put((a8, b8, sa, sb), cpu))
        assert_within_bound(out, out_cpu, abs_sum, out_dtype, "vs CPU handler", roundings=2)


def test_fp8_batched_with_one_scale_per_batch_element(gpu, cpu):
    """[3, M, K] x [3, N, K], scales 2^-8 .. 2^6 apart (one cuBLASLt call per element)."""
    require("fp8")
    ka, kb = jax.random.split(jax.random.key(5))
    x = jax.random.normal(ka, (3, 96, 64)) * jnp.asarray([1.0, 2.0**-8, 2.0**6])[:, None, None]
    w = jax.random.normal(kb, (3, 80, 64)) * jnp.asarray([2.0**5, 1.0, 2.0**-4])[:, None, None]
    a8, sa = jax.vmap(lambda t: per_tensor(t, E4))(x)
    b8, sb = jax.vmap(lambda t: per_tensor(t, E5))(w)
    f = _fp8(jnp.float32)
    out = f(*jax.device_put((a8, b8, sa, sb), gpu))
    xs = a8.astype(jnp.float32) * sa[:, None, None]
    ys = b8.astype(jnp.float32) * sb[:, None, None]
    ref, abs_sum = emulation(xs, ys)
    assert_within_bound(out, ref, abs_sum, jnp.float32, "vs emulation")
    out_cpu = f(*jax.device_put((a8, b8, sa, sb), cpu))
    assert_within_bound(out, out_cpu, abs_sum, jnp.float32, "vs CPU handler")


CURRENT_CASES = [  # (M, N, K), (lhs format, rhs format, out dtype); K = 200: padded to 208
    ((96, 80, 200), ("fp8_e4m3_tensor", "fp8_e5m2_tensor", jnp.bfloat16)),
    ((333, 77, 160), ("fp8_e4m3_row", "fp8_e4m3_row", jnp.float32)),
    ((64, 130, 96), ("fp8_e5m2_row", "fp8_e4m3_tensor", jnp.float16)),
]


@pytest.mark.parametrize("mode", ["fp32", "pow2"])
@pytest.mark.parametrize("case", CURRENT_CASES, ids=lambda c: "x".join(c[1][:2]))
def test_tensor_and_row_formats_match_the_emulation_and_the_cpu_handler(gpu, cpu, case, mode):
    """``jaxmx.matmul(backend="ffi")`` on per-tensor / per-row FP8 MXArrays: the per-tensor FP8
    GEMM with decode factors ``1/s``, or unit scales and the row scales on its float32 result."""
    require("fp8")
    (m, n, k), (fa, fb, out_dtype) = case
    ka, kb = jax.random.split(jax.random.key(m + n + k))
    a = jaxmx.quantize(exponent_varied(ka, (m, k)), fa, scale_mode=mode)
    b = jaxmx.quantize(exponent_varied(kb, (n, k)), fb, scale_mode=mode)
    f = jax.jit(lambda a, b: jaxmx.matmul(a, b, out_dtype, backend="ffi"))
    check_native_gemm(f, a, b, out_dtype, gpu, cpu)


@pytest.mark.parametrize("name", ["FP8_TENSORWISE", "FP8_ROWWISE"])
def test_tensorwise_and_rowwise_recipes_forward_and_backward_on_the_native_gemm(gpu, name):
    """The three GEMMs of ``jaxmx.dot_general`` under the recipe: ``backend="auto"`` lowers
    them to the native call on the device (the forward with fast accumulation) and agrees with
    ``"emulate"`` within 2^-7 of the largest entry, as ``"ffi"`` does."""
    require("fp8")
    x = exponent_varied(jax.random.key(11), (256, 512))
    w = exponent_varied(jax.random.key(12), (384, 512))
    g = exponent_varied(jax.random.key(13), (256, 384))
    tn = (((1,), (1,)), ((), ()))

    def step(backend):
        recipe = getattr(jaxmx.recipes, name).replace(backend=backend)

        def f(x, w, g):
            y, pullback = jax.vjp(lambda x, w: jaxmx.dot_general(x, w, tn, recipe=recipe), x, w)
            return (y, *pullback(g))

        return jax.jit(f)

    args = jax.device_put((x, w, g), gpu)
    if not DRY_RUN:  # on the CPU standing in for the GPU, "auto" emulates
        text = step("auto").lower(*args).as_text()
        assert text.count("jaxmx_fp8_matmul") >= 3, "auto did not choose the native GEMM"
    want = step("emulate")(*args)
    for backend in ("auto", "ffi"):
        got = step(backend)(*args)
        for what, o, e in zip(("y", "dx", "dw"), got, want, strict=True):
            err = float(jnp.max(jnp.abs(o - e))) / float(jnp.max(jnp.abs(e)))
            assert err <= 2.0**-7, f"{backend} {what}: max |native - emulate| / max = {err:.3g}"


def test_fp8_below_its_compute_capability_is_refused(gpu):
    a8, sa = per_tensor(jnp.ones((128, 64)), E4)
    args = jax.device_put((a8, a8, sa, sa), gpu)
    assert_refused("fp8", gpu, lambda: _fp8(jnp.float32)(*args))


def test_probe_an_unpadded_n_of_132(gpu):
    """Informational (never fails on cuBLASLt's answer): whether cuBLASLt takes N % 16 != 0 with
    16-byte aligned float32 output rows, the custom call called without the rhs pad the library
    applies. Says whether that pad (a copy of the rhs, a slice of the output) could shrink."""
    require("fp8")
    ka, kb = jax.random.split(jax.random.key(7))
    a = jax.random.normal(ka, (64, 128)).astype(E4)
    b = jax.random.normal(kb, (132, 128)).astype(E4)
    one = jnp.ones((), jnp.float32)
    call = jax.ffi.ffi_call(
        ffi.FP8_TARGET,
        (
            jax.ShapeDtypeStruct((64, 132), jnp.float32),
            jax.ShapeDtypeStruct((ffi.WORKSPACE_BYTES + 256,), jnp.uint8),
        ),
    )
    ffi.register_targets()
    f = jax.jit(lambda a, b, s: call(a, b, s, s, fast_accum=False)[0])
    try:
        out = f(*jax.device_put((a, b, one), gpu))
    except jax.errors.JaxRuntimeError as e:
        print(f"N = 132 without the pad: refused ({str(e).splitlines()[0][:200]})")
        return
    ref, abs_sum = emulation(a.astype(jnp.float32), b.astype(jnp.float32))
    assert_within_bound(out, ref, abs_sum, jnp.float32, "N = 132 without the pad, accepted")
    print("N = 132 without the pad: accepted (the rhs pad could shrink)")
