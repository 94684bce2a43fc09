"""Block FP8 (``jaxmx.ffi.block_fp8_matmul``, cuBLASLt VEC128_32F / BLK128x128_32F) on a CUDA
device: the DeepSeek-V3 GEMM shapes against ``jaxmx.dequantize`` + float32 ``jnp.dot`` and the
CPU handler, ``DEEPSEEK_FP8`` with ``backend="ffi"`` against ``"emulate"``, and the capability
error where the device has no block-FP8 GEMM."""

import jax
import jax.numpy as jnp
import pytest
from gpu_helpers import (
    assert_refused,
    check_native_gemm,
    exponent_varied,
    require,
    skip_large_in_dry_run,
)

import jaxmx
from jaxmx import ffi

pytestmark = pytest.mark.gpu

E4, E5, TILE = "fp8_e4m3_block", "fp8_e5m2_block", (128, 128)
CASES = [  # (label, M, N, K, lhs format, lhs tile, rhs format, rhs tile, out dtype)
    ("fwd 1x128 x 128x128", 128, 128, 128, E4, None, E4, TILE, jnp.bfloat16),
    ("fwd 1x128 x 128x128", 1, 256, 4096, E4, None, E4, TILE, jnp.bfloat16),
    ("fwd 1x128 x 128x128", 100, 200, 384, E4, None, E4, TILE, jnp.float32),
    ("dgrad 1x128 x 128x128", 257, 384, 1024, E4, None, E4, TILE, jnp.float32),
    ("wgrad 1x128 x 1x128", 130, 1000, 512, E4, None, E4, None, jnp.float32),
    ("128x128 x 1x128", 256, 96, 640, E4, TILE, E4, None, jnp.float16),
    ("e5m2 x e4m3 fwd", 64, 256, 256, E5, None, E4, TILE, jnp.float32),
    ("fwd 1x128 x 128x128", 2048, 2048, 2048, E4, None, E4, TILE, jnp.bfloat16),
]


def _case_id(case):
    label, m, n, k, *_, out_dtype = case
    return f"{label.replace(' ', '_')}-{m}x{n}x{k}-{jnp.dtype(out_dtype).name}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_block_fp8_matches_the_emulation_and_the_cpu_handler(gpu, cpu, case):
    require("block_fp8")
    _, m, n, k, fa, ta, fb, tb, out_dtype = case
    skip_large_in_dry_run(m, n, k)
    ka, kb = jax.random.split(jax.random.key(m + n + k))
    a = jaxmx.quantize(exponent_varied(ka, (m, k)), fa, tile=ta)
    b = jaxmx.quantize(exponent_varied(kb, (n, k)), fb, tile=tb)
    f = jax.jit(lambda a, b: ffi.block_fp8_matmul(a, b, out_dtype))
    check_native_gemm(f, a, b, out_dtype, gpu, cpu)


def test_deepseek_fp8_forward_and_backward_on_the_native_gemm(gpu):
    """The forward GEMM and both backward GEMMs of ``jaxmx.dot_general`` under DEEPSEEK_FP8:
    ``backend="ffi"`` within 2^-7 of the largest entry of ``"emulate"``'s."""
    require("block_fp8")
    x = exponent_varied(jax.random.key(8), (256, 512))
    w = exponent_varied(jax.random.key(9), (384, 512))
    g = exponent_varied(jax.random.key(10), (256, 384))
    tn = (((1,), (1,)), ((), ()))

    def run(backend):
        recipe = jaxmx.recipes.DEEPSEEK_FP8.replace(backend=backend)
        f = jax.jit(lambda x, w: jaxmx.dot_general(x, w, tn, recipe=recipe))
        y, pullback = jax.vjp(f, *jax.device_put((x, w), gpu))
        return (y, *pullback(jax.device_put(g, gpu)))

    for name, got, want in zip(("y", "dx", "dw"), run("ffi"), run("emulate"), strict=True):
        err = float(jnp.max(jnp.abs(got - want))) / float(jnp.max(jnp.abs(want)))
        assert err <= 2.0**-7, f"{name}: max |ffi - emulate| / max |emulate| = {err:.3g}"


def test_block_fp8_off_its_compute_capability_is_refused(gpu):
    a = jax.device_put(jaxmx.quantize(jnp.ones((128, 128)), E4), gpu)
    assert_refused("block_fp8", gpu, lambda: ffi.block_fp8_matmul(a, a))
