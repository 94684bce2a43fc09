"""The differential harness of tests/test_backend_differential.py on a CUDA device: the hard
inputs of tests/hard_gemm_inputs.py through cuBLASLt (``backend="ffi"``), ``backend="xla"`` and
the emulation on the device, against the float64 reference. cuBLASLt is held to its documented
accumulator bound (``ACCUMULATION * sum_k |a_k b_k|``, docs/native.md); ``xla`` and the emulation to
the differential bound (``xla`` to cuBLASLt's, where XLA may keep the op native)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_helpers import ACCUMULATION, DRY_RUN, expect_hopper_failure
from hard_gemm_inputs import MX_GROUPS, block_group, mx_group, problems

from jaxmx._src.gemm import capabilities
from jaxmx._src.gemm.dispatch import Gemm, kernels
from jaxmx._src.gemm.kernels import execute

pytestmark = pytest.mark.gpu

MX_PAIRS = [  # (formats, native family)
    (("mxfp8_e4m3", "mxfp8_e4m3"), "mx"),
    (("mxfp8_e5m2", "mxfp8_e4m3"), "mx"),
    (("mxfp4", "mxfp4"), "fp4"),
]
BLOCK_PAIRS = [("fp8_e4m3_block", "fp8_e4m3_block"), ("fp8_e5m2_block", "fp8_e4m3_block")]


def _run(backend, a, b, device, scale_mode=None):
    chosen = kernels(Gemm(formats=(a.fmt, b.fmt), backend=backend, scale_mode=scale_mode))
    a, b = jax.device_put((a, b), device)
    return np.asarray(jax.jit(lambda a, b: execute(chosen, a, b, jnp.float32))(a, b))


def _native(family):
    if not (DRY_RUN or capabilities.probe().supports(family)):
        pytest.skip(f"this GPU has no native {family} GEMM")


@pytest.mark.parametrize("group", list(MX_GROUPS))
@pytest.mark.parametrize(("formats", "family"), MX_PAIRS, ids=["x".join(p[0]) for p in MX_PAIRS])
def test_mx_hard_inputs_on_the_device(gpu, formats, family, group):
    names, a, b, x, y = mx_group(formats, group)
    emulated = _run("emulate", a, b, gpu)
    assert not problems(emulated, x, y, names, partial_overflow=False), "emulate"
    # XLA may keep the op native on a GPU (cuDNN, Triton): the accumulator's bound
    bad = problems(_run("xla", a, b, gpu), x, y, names, relative=ACCUMULATION)
    assert not bad, "xla: " + "; ".join(bad[:8])
    _native(family)
    bad = problems(_run("ffi", a, b, gpu), x, y, names, relative=ACCUMULATION)
    assert not bad, "cuBLASLt: " + "; ".join(bad[:8])


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32"])
@pytest.mark.parametrize("formats", BLOCK_PAIRS, ids=["x".join(p) for p in BLOCK_PAIRS])
def test_block_fp8_hard_inputs_on_the_device(request, gpu, formats, pow2):
    if not pow2 and formats == BLOCK_PAIRS[0]:  # huge_and_tiny: inf from cuBLASLt
        expect_hopper_failure(request, "scale_overflow")
    names, a, b, x, y = block_group(formats, pow2)
    mode = "pow2" if pow2 else "fp32"
    emulated = _run("emulate", a, b, gpu, mode)
    assert not problems(emulated, x, y, names, decodes_to_float32=not pow2), "emulate"
    _native("block_fp8")
    out = _run("ffi", a, b, gpu, mode)
    bad = problems(out, x, y, names, decodes_to_float32=True, relative=ACCUMULATION)
    assert not bad, "cuBLASLt: " + "; ".join(bad[:8])
