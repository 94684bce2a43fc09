"""K-first (non-TN) operands of the native MX GEMM, chosen per architecture at trace time.

On compute capability 10.x :func:`jaxmx.ffi.mx_matmul` hands a K-first operand ([..., K, rows],
quantized along K) to the custom call untransposed; everywhere else it transposes it to TN form.
Here the choice is driven by the machine a test assumes (tests/machines.py), and the CPU
handler, which takes both layouts, is checked bit for bit against the TN call and a numpy +
ml_dtypes reference. (The cuBLASLt core's non-TN matmuls are checked against the test double
in test_cublaslt_core.py.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from machines import BLACKWELL, BLACKWELL_12X

import jaxmx
from jaxmx import ffi
from jaxmx._src.gemm.capabilities import Capabilities

TN = (((1,), (1,)), ((), ()))
LAYOUTS = [(True, False), (False, True), (True, True)]  # (lhs, rhs) K-first


@pytest.fixture
def non_tn(machine):
    """``choose(flag)``: make ``mx_matmul`` pass K-first operands untransposed (True, as on a
    10.x device) or transpose them (False, the all-TN path of a 12.x device)."""

    def choose(flag: bool):
        machine(BLACKWELL if flag else BLACKWELL_12X)

    return choose


def operand(x, k_first: bool, fmt="mxfp8_e4m3"):
    """``x`` [..., rows, K] quantized along K, as the TN form or as a K-first [..., K, rows]."""
    if k_first:
        return jaxmx.quantize(jnp.swapaxes(x, -1, -2), fmt, axis=x.ndim - 2)
    return jaxmx.quantize(x, fmt)


def reference(a: jaxmx.MXArray, b: jaxmx.MXArray) -> np.ndarray:
    """float32 [..., M, N] of the CPU handler's numerics, in numpy: each 32-element block's
    products summed exactly (float64), times both E8M0 scales, rounded to float32 and added over
    K in order in float32 (exact for E4M3 x E4M3 blocks)."""

    def rows_k(q):  # codes [..., rows, Kp] as float64 and scale exponents [..., rows, Kp/32]
        codes = np.asarray(q.data).astype(np.float64)
        exps = np.asarray(q.scale).view(np.uint8).astype(np.int64) - 127
        if q.axis == q.ndim - 2:
            codes, exps = codes.swapaxes(-1, -2), exps.swapaxes(-1, -2)
        return codes, exps

    (x, ex), (y, ey) = rows_k(a), rows_k(b)
    blocks = x.shape[-1] // 32
    xb = x.reshape(*x.shape[:-1], blocks, 32)
    yb = y.reshape(*y.shape[:-1], blocks, 32)
    sums = np.einsum("...mcj,...ncj->...mnc", xb, yb)
    scaled = np.ldexp(sums, ex[..., :, None, :] + ey[..., None, :, :]).astype(np.float32)
    acc = np.zeros(scaled.shape[:-1], np.float32)
    for c in range(blocks):
        acc = acc + scaled[..., c]
    return acc


def lowered(f, *args) -> str:
    """The StableHLO of ``f``, traced afresh (a new function object: no jit cache hit)."""
    return jax.jit(lambda *xs: f(*xs)).lower(*args).as_text()


@pytest.mark.parametrize("k_first", LAYOUTS)
@pytest.mark.parametrize("batch,m,n,k", [((), 5, 7, 64), ((2,), 3, 16, 80), ((2, 3), 33, 4, 32)])
def test_k_first_operands_equal_the_tn_call_and_numpy(non_tn, k_first, batch, m, n, k):
    rng = np.random.default_rng(m * n + k)
    x = jnp.asarray(rng.standard_normal((*batch, m, k)) * 4.0, jnp.float32)
    w = jnp.asarray(rng.standard_normal((*batch, n, k)), jnp.float32)
    a, b = operand(x, k_first[0]), operand(w, k_first[1])

    def mm(a, b):
        return ffi.mx_matmul(a, b, jnp.float32)

    non_tn(True)
    text = lowered(mm, a, b)
    assert f"lhs_k_first = {str(k_first[0]).lower()}" in text  # untransposed to the handler
    assert f"rhs_k_first = {str(k_first[1]).lower()}" in text
    got = np.asarray(jax.jit(lambda a, b: mm(a, b))(a, b))
    non_tn(False)
    assert "lhs_k_first = true" not in lowered(mm, a, b)  # the all-TN path
    assert "rhs_k_first = true" not in lowered(mm, a, b)
    tn = np.asarray(mm(a, b))
    np.testing.assert_array_equal(got, tn)
    np.testing.assert_array_equal(got, reference(a, b))
    assert got.shape == (*batch, m, n)


def test_e5m2_and_bfloat16_outputs_are_the_same_bits_in_both_layouts(non_tn):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((16, 96)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((24, 96)), jnp.float32)
    a, b = operand(x, True, "mxfp8_e5m2"), operand(w, True)
    non_tn(True)
    got = ffi.mx_matmul(a, b)
    non_tn(False)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ffi.mx_matmul(a, b)))
    expected = reference(a, b).astype(ml_dtypes.bfloat16)
    np.testing.assert_allclose(np.asarray(got, np.float32), expected.astype(np.float32), rtol=0.01)


@pytest.mark.parametrize("in_axes", [(0, None), (0, 0), (None, 0)])
def test_vmap_over_k_first_operands(non_tn, in_axes):
    rng = np.random.default_rng(11)
    xs = [operand(jnp.asarray(rng.standard_normal((8, 64)), jnp.float32), True) for _ in range(3)]
    ws = [operand(jnp.asarray(rng.standard_normal((16, 64)), jnp.float32), True) for _ in range(3)]

    def stacked(qs):
        return jax.tree.map(lambda *leaves: jnp.stack(leaves), *qs)

    a = stacked(xs) if in_axes[0] == 0 else xs[0]
    b = stacked(ws) if in_axes[1] == 0 else ws[0]

    def mm(a, b):
        return ffi.mx_matmul(a, b, jnp.float32)

    non_tn(True)
    got = np.asarray(jax.jit(jax.vmap(mm, in_axes=in_axes))(a, b))
    non_tn(False)
    np.testing.assert_array_equal(got, np.asarray(jax.vmap(mm, in_axes=in_axes)(a, b)))
    for i in range(3):
        a_i = xs[i] if in_axes[0] == 0 else xs[0]
        b_i = ws[i] if in_axes[1] == 0 else ws[0]
        np.testing.assert_array_equal(got[i], reference(a_i, b_i))


@pytest.mark.parametrize(
    "cc,expected", [((10, 0), True), ((10, 3), True), ((9, 0), False), ((12, 0), False)]
)
def test_the_layout_is_chosen_per_compute_capability(machine, cc, expected):
    machine(Capabilities(compute_capability=cc, cublaslt_version=120800))
    assert Capabilities(compute_capability=cc, cublaslt_version=120800).non_tn_mx is expected
    assert Capabilities(compute_capability=(11, 0), cublaslt_version=120800).non_tn_mx is False

    x = operand(jnp.ones((16, 64)), True)
    w = operand(jnp.ones((32, 64)), False)
    text = lowered(lambda a, b: jaxmx.matmul(a, b, jnp.float32, backend="ffi"), x, w)
    assert ("lhs_k_first = true" in text) is expected


def test_no_device_keeps_the_all_tn_path():
    assert Capabilities().non_tn_mx is False
    old_library = Capabilities(compute_capability=(10, 0), cublaslt_version=120700)
    assert old_library.non_tn_mx is False  # no MX GEMM there at all


def test_block_fp8_and_fp4_stay_tn(non_tn):
    non_tn(True)
    x = jnp.ones((128, 256))
    for fmt, target in (
        ("fp8_e4m3_block", "jaxmx_block_fp8_matmul"),
        ("mxfp4", "jaxmx_fp4_matmul"),
    ):
        a = operand(x, True, fmt)
        text = lowered(lambda a, b: jaxmx.matmul(a, b, jnp.float32, backend="ffi"), a, a)
        assert target in text and "k_first" not in text


def test_a_training_step_with_the_ffi_backend_is_unchanged(non_tn):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((48, 64)), jnp.float32)
    recipe = jaxmx.recipes.MXFP8.replace(backend="ffi")

    def loss(x, w):
        y = jaxmx.dot_general(x, w, TN, recipe=recipe)
        return jnp.sum(y * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) / y.size)

    def step(x, w):  # a fresh jit each time: the layout is chosen while tracing
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

    non_tn(True)
    text = lowered(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
    assert "lhs_k_first = true" in text or "rhs_k_first = true" in text  # a gradient GEMM
    got = step(x, w)
    non_tn(False)
    assert "k_first = true" not in lowered(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
    want = step(x, w)
    for g, t in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(t))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest.py)")
@pytest.mark.parametrize("k_first", LAYOUTS)
@pytest.mark.parametrize("k_sharded", [False, True])
def test_spmd_partitions_k_first_operands(non_tn, k_first, k_sharded):
    """Rows sharded on one mesh axis, K on the other or not at all: the custom call runs on each
    device's K-first blocks (no gather), equal to one device bit for bit without a split K."""
    mesh = jax.make_mesh((2, 4), ("r", "k"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(17)
    x = jnp.asarray(rng.standard_normal((64, 512)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 512)), jnp.float32)
    a, b = operand(x, k_first[0]), operand(w, k_first[1])
    k = "k" if k_sharded else None

    def spec(k_first_operand, rows):
        return P(k, rows) if k_first_operand else P(rows, k)

    a_sh = jax.device_put(a, NamedSharding(mesh, spec(k_first[0], "r")))
    b_sh = jax.device_put(b, NamedSharding(mesh, spec(k_first[1], None)))
    non_tn(True)
    f = jax.jit(lambda a, b: ffi.mx_matmul(a, b, jnp.float32))
    compiled = f.lower(a_sh, b_sh).compile().as_text()
    assert "all-gather" not in compiled
    assert ("all-reduce" in compiled or "reduce-scatter" in compiled) is k_sharded
    got = np.asarray(f(a_sh, b_sh))
    one = reference(a, b)
    if k_sharded:  # float32 partial sums added in another order
        np.testing.assert_allclose(got, one, rtol=2.0**-16, atol=1e-6 * np.abs(one).max())
    else:
        np.testing.assert_array_equal(got, one)
