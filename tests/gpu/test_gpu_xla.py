"""``backend="xla"`` (``jax.lax.scaled_dot``) on a CUDA device: its result against the emulation
on the device (the decoded operands, float32 ``jnp.dot`` at HIGHEST) and, where cuBLASLt runs the
format, against the FFI GEMM; and which kernel XLA compiled it to (the docs' per-platform table:
a cuDNN fusion, a Triton scaled dot, or the decomposition)."""

import re

import jax
import jax.numpy as jnp
import pytest
from gpu_helpers import DRY_RUN, assert_within_bound, emulation, exponent_varied

import jaxmx
from jaxmx._src.gemm import capabilities

pytestmark = pytest.mark.gpu

FORMATS = [("mxfp8_e4m3", "mx"), ("mxfp8_e5m2", None), ("mxfp4", "fp4"), ("nvfp4", "fp4")]
SHAPES = [(128, 128, 128), (100, 200, 96), (1024, 1024, 1024)]


def _matmul(backend):
    return jax.jit(lambda a, b: jaxmx.matmul(a, b, jnp.float32, backend=backend))


def kernel_kind(hlo: str) -> str:
    """What the compiled HLO runs the GEMM as (for the docs' table)."""
    if "__cudnn$fusion" in hlo:
        return "cudnn"
    if re.search(r"\sscaled-dot\(", hlo):  # the kScaledDot instruction, kept for Triton
        return "scaled-dot (Triton)"
    return "decomposition"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(("fmt", "family"), FORMATS, ids=[f for f, _ in FORMATS])
def test_xla_matches_the_emulation_and_the_ffi(gpu, fmt, family, shape):
    m, n, k = shape
    ka, kb = jax.random.split(jax.random.key(m + n + k))
    a = jaxmx.quantize(exponent_varied(ka, (m, k)), fmt)
    b = jaxmx.quantize(exponent_varied(kb, (n, k)), fmt)
    a, b = jax.device_put((a, b), gpu)
    out = _matmul("xla")(a, b)
    ref, abs_sum = emulation(jaxmx.dequantize(a), jaxmx.dequantize(b))
    assert_within_bound(out, ref, abs_sum, jnp.float32, "xla vs emulation")
    assert_within_bound(out, _matmul("emulate")(a, b), abs_sum, jnp.float32, "xla vs emulate")
    if family is not None and (DRY_RUN or capabilities.probe().supports(family)):
        assert_within_bound(out, _matmul("ffi")(a, b), abs_sum, jnp.float32, "xla vs ffi")
    hlo = _matmul("xla").lower(a, b).compile().as_text()
    print(f"{fmt} {shape}: {kernel_kind(hlo)}")
