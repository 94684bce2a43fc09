"""Every public array function takes sharded inputs, on Auto and on Explicit mesh axes.

Each case runs on a [128, 256] activation and a [128, 256] weight sharded over a 2 x 4 mesh
(rows over ``data``, columns over ``model``), under ``jit`` and (Explicit axes, inside
``jax.set_mesh``) eagerly, and is compared with the same call on one device: codes, scales,
counts and element-wise results bit for bit; sums that the sharding splits (GEMM outputs, the
statistics' float32 sums) within float32 summation error, relative ``2^-16`` of the largest
reference entry (a sum over a few thousand terms in another order; about 4000 times below
MXFP8's own rounding error).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmx
from jaxmx import diagnostics as dg

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest.py)")

REL_TOL = 2.0**-16
DIMS = (((1,), (1,)), ((), ()))  # x [M, K] . w [N, K]


def _loss(x, w):
    c = jnp.cos(jnp.arange(x.shape[0] * w.shape[0], dtype=jnp.float32)).reshape(x.shape[0], -1)
    return (jaxmx.dot_general(x, w, DIMS) * c).sum()  # linear in y: the output gradient is c


def _telemetry(x, w):
    def loss(x, w, taps):
        with dg.telemetry(taps) as tel:
            return _loss(x, w), tel.forward

    taps = dg.gemm_taps(loss, x, w)
    (_, fwd), (_, grads) = jax.jit(jax.value_and_grad(loss, (0, 2), has_aux=True))(x, w, taps)
    return dg.telemetry_report(fwd, grads)


# name -> (function of (x, w), the leaves compared bit for bit: all, or only the integer ones)
CASES = {
    "quantize": (lambda x, w: jaxmx.quantize(x, "mxfp8_e4m3"), "all"),
    "quantize_nvfp4": (lambda x, w: jaxmx.quantize(x, "nvfp4"), "all"),
    "dequantize": (lambda x, w: jaxmx.dequantize(jaxmx.quantize(x, "mxfp4")), "all"),
    "quantize_rowwise_colwise": (lambda x, w: jaxmx.quantize_rowwise_colwise(x), "all"),
    "fake_quantize": (lambda x, w: jaxmx.fake_quantize(x), "all"),
    "requantize": (lambda x, w: jaxmx.requantize(x * 1.01, jaxmx.quantize(x)), "all"),
    "rht": (lambda x, w: jaxmx.rht(x, -1, jax.random.key(1)), "all"),
    "swizzle_scales": (lambda x, w: jaxmx.swizzle_scales(jaxmx.quantize(x).scale), "all"),
    "unswizzle_scales": (
        lambda x, w: jaxmx.unswizzle_scales(jaxmx.swizzle_scales(jaxmx.quantize(x).scale), 128, 8),
        "all",
    ),
    "matmul": (lambda x, w: jaxmx.matmul(jaxmx.quantize(x), jaxmx.quantize(w), jnp.float32), ""),
    "dot_general_step": (lambda x, w: jax.value_and_grad(_loss, (0, 1))(x, w), ""),
    "einsum": (lambda x, w: jaxmx.einsum("mk,nk->mn", x, w), ""),
    "granularity": (lambda x, w: dg.granularity(x), "int"),
    "granularity_fp4": (lambda x, w: dg.granularity(x, fmt="fp4_e2m1"), "int"),
    "block_stats": (lambda x, w: dg.block_stats(x), "int"),
    "block_stats_nvfp4": (lambda x, w: dg.block_stats(x, "nvfp4"), "int"),
    "leg_stats": (lambda x, w: dg.leg_stats(x, "mxfp8_e4m3", -1, "floor"), "int"),
}
# read outside jit: results that are not arrays
EAGER = {
    "recommendation": lambda x, w: dg.granularity(x).recommendation.level,
    "block_stats_summary": lambda x, w: dg.block_stats(x).summary(),
    "advise": lambda x, w: dg.advise(_loss, x, w).recipes(),
    "telemetry": _telemetry,
}


@pytest.fixture(scope="module")
def operands():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (128, 256)) * jnp.logspace(-3, 3, 256)
    w = jax.random.normal(kw, (128, 256)) * 0.05
    return x, w


@pytest.fixture(scope="module")
def references(operands):
    one = jax.devices()[0]
    args = jax.device_put(operands, one)
    cache = {}

    def get(name):
        if name not in cache:
            fn = CASES[name][0] if name in CASES else EAGER[name]
            cache[name] = (jax.jit(fn) if name in CASES else fn)(*args)
        return cache[name]

    return get


def sharded(operands, kind):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind,) * 2)
    return mesh, jax.device_put(operands, NamedSharding(mesh, P("data", "model")))


def check_equal(name, got, want, exact: str) -> None:
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert jax.tree.structure(got) == jax.tree.structure(want), name
    for i, (g, r) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        g, r = np.asarray(g), np.asarray(r)
        assert g.shape == r.shape and g.dtype == r.dtype, (name, i, g.shape, r.shape)
        if exact == "all" or (exact == "int" and not np.issubdtype(r.dtype, np.floating)):
            np.testing.assert_array_equal(g, r, err_msg=f"{name} leaf {i}")
        else:
            r64, g64 = r.astype(np.float64), g.astype(np.float64)
            finite = np.isfinite(r64)
            np.testing.assert_array_equal(finite, np.isfinite(g64), err_msg=f"{name} leaf {i}")
            scale = np.abs(r64[finite]).max(initial=0.0)
            err = np.abs(g64[finite] - r64[finite]).max(initial=0.0)
            assert err <= REL_TOL * scale, f"{name} leaf {i}: {err} > 2^-16 x {scale}"


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("name", CASES)
def test_public_functions_take_sharded_arrays_under_jit(operands, references, name, kind):
    mesh, args = sharded(operands, kind)
    fn, exact = CASES[name]
    with jax.set_mesh(mesh):
        got = jax.jit(fn)(*args)
    check_equal(name, got, references(name), exact)


# eagerly: the functions that reshape or sort (each op dispatched on its own is slow)
EAGERLY = (
    "quantize_rowwise_colwise",
    "swizzle_scales",
    "matmul",
    "granularity",
    "block_stats",
    "leg_stats",
    *EAGER,
)


@pytest.mark.parametrize("name", EAGERLY)
def test_public_functions_take_explicitly_sharded_arrays_eagerly(operands, references, name):
    mesh, args = sharded(operands, AxisType.Explicit)
    fn = CASES[name][0] if name in CASES else EAGER[name]
    with jax.set_mesh(mesh):
        got = fn(*args)
    want = references(name)
    if name in ("recommendation", "advise"):
        assert got == want, (name, got, want)
    else:
        check_equal(name, got, want, CASES[name][1] if name in CASES else "int")
