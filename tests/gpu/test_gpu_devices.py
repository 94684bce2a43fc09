"""Several GPUs on one host: the per-tensor FP8 GEMM on each (one cuBLASLt handle per device,
created with that device current) against the CPU handler."""

import jax
import jax.numpy as jnp
import pytest
from gpu_helpers import DRY_RUN, assert_within_bound, emulation, per_tensor, require

from jaxmx import ffi

pytestmark = pytest.mark.gpu


def test_fp8_on_every_device(cpu):
    require("fp8")
    devices = jax.devices("cpu")[:2] if DRY_RUN else jax.devices("cuda")
    if len(devices) < 2:
        pytest.skip(f"one CUDA device ({devices[0].device_kind}): needs two or more")
    ka, kb = jax.random.split(jax.random.key(8))
    a8, sa = per_tensor(jax.random.normal(ka, (128, 256)), jnp.float8_e4m3fn)
    b8, sb = per_tensor(jax.random.normal(kb, (96, 256)), jnp.float8_e4m3fn)
    f = jax.jit(lambda a, b, s, t: ffi.fp8_matmul(a, b, s, t, jnp.float32))
    expected = f(*jax.device_put((a8, b8, sa, sb), cpu))
    _, abs_sum = emulation(a8.astype(jnp.float32) * sa, b8.astype(jnp.float32) * sb)
    for device in reversed(devices):  # the last device first: not the default one
        out = f(*jax.device_put((a8, b8, sa, sb), device))
        assert out.devices() == {device}
        assert_within_bound(out, expected, abs_sum, jnp.float32, f"on {device}")
