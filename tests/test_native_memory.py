"""Eager native GEMM calls keep memory flat: each call reuses one compiled executable."""

import os

import jax.numpy as jnp
import pytest

import jaxmx
from jaxmx import ffi

FFI = jaxmx.recipes.MXFP8.replace(backend="ffi")
TN = (((1,), (1,)), ((), ()))


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


CALLS = {
    "ffi.mx_matmul": lambda a, b, x, w: ffi.mx_matmul(a, b, jnp.float32),
    "matmul(backend='ffi')": lambda a, b, x, w: jaxmx.matmul(a, b, jnp.float32, backend="ffi"),
    "dot_general(ffi recipe)": lambda a, b, x, w: jaxmx.dot_general(x, w, TN, recipe=FFI),
    "ffi.fp8_matmul": lambda a, b, x, w: ffi.fp8_matmul(a.data, b.data, 1.0, 1.0),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_eager_native_calls_do_not_leak(name):
    call = CALLS[name]
    x, w = jnp.ones((64, 64)), jnp.ones((32, 64))
    a, b = jaxmx.quantize(x), jaxmx.quantize(w)
    for _ in range(50):  # compile, warm the caches
        call(a, b, x, w).block_until_ready()
    before = resident_mb()
    for _ in range(1000):
        call(a, b, x, w).block_until_ready()
    grown = resident_mb() - before
    assert grown < 40, f"{name}: resident memory grew {grown:.0f} MB over 1000 eager calls"
