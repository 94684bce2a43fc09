"""Per-tensor and per-row FP8 on the native per-tensor FP8 GEMM (``jaxmx_fp8_matmul``): the CPU
handler against a float64 reference of the quantized operands (torchao's current scaling, as
modelled in tests/test_tensor_row_fp8.py) and the emulation, the dispatcher's choice per
machine, the training GEMM, and the cuBLASLt core against its test double.

The bound both the native GEMM and the emulation keep (docs/native.md): per output entry,
``|got - exact| <= (K + 4) * 2^-24 * sum_k |a_k b_k|`` with ``a_k``, ``b_k`` the decoded
values, since each is a float32 sum of K products with at most four more float32 roundings (the
emulation's two decodes and product, or the native GEMM's decode factors and final scaling).
"""

import functools

import bounds
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from machines import BLACKWELL, BLACKWELL_12X, HOPPER
from test_cublaslt_core import Machine, build, placed, plain_matmul

import jaxmx
from jaxmx import recipes
from jaxmx._src.gemm.capabilities import Capabilities
from jaxmx._src.gemm.dequantized_matmul import DEQUANTIZED
from jaxmx._src.gemm.dispatch import Gemm, kernels
from jaxmx._src.gemm.native import FP8_KERNEL, tn_codes

TN = (((1,), (1,)), ((), ()))
ADA = Capabilities(compute_capability=(8, 9), cublaslt_version=120800)
AMPERE = Capabilities(compute_capability=(8, 0), cublaslt_version=120800)
PAIRS = [  # cuBLASLt's FP8 type table, without E5M2 x E5M2
    ("fp8_e4m3_tensor", "fp8_e4m3_tensor"),
    ("fp8_e4m3_tensor", "fp8_e5m2_tensor"),
    ("fp8_e5m2_tensor", "fp8_e4m3_tensor"),
    ("fp8_e4m3_row", "fp8_e4m3_row"),
    ("fp8_e5m2_row", "fp8_e4m3_row"),
    ("fp8_e4m3_tensor", "fp8_e5m2_row"),  # mixed spans: the per-row path
]


def decoded(x, fmt, axis, mode):
    """float64 values of the reference quantization of ``x`` along ``axis``."""
    codes, scale = ref.current_fp8(x, fmt, axis, mode)
    return codes.astype(np.float64) / scale.astype(np.float64)


def assert_within_bound(got, exact, abs_sum, k):
    """docs/native.md: within ``(K + 4) u sum_k |a_k b_k|`` of the exact sum (float32 output)."""
    bounds.assert_within(got, exact, bounds.against_exact(abs_sum, k, exact))


def operands(seed, m, n, k):
    """x [M, K], w [N, K] with magnitudes spread over 2^-20 .. 2^20 and differing per row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * 2.0 ** rng.uniform(-20, 20, (m, 1))
    w = rng.standard_normal((n, k)) * 2.0 ** rng.uniform(-20, 20, (n, 1))
    return x.astype(np.float32), w.astype(np.float32)


def lowered(f, *args, platforms=("cpu",)) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=platforms).as_text()


# --- the CPU handler against the float64 reference and the emulation --------------------------


@pytest.mark.parametrize("mode", ["fp32", "pow2"])
@pytest.mark.parametrize("fa,fb", PAIRS)
def test_the_native_gemm_equals_the_emulation_within_the_float32_bound(fa, fb, mode):
    m, n, k = 5, 7, 40  # K not a multiple of 16: padded with zero codes for cuBLASLt
    x, w = operands(len(fa) + len(fb), m, n, k)
    a = jaxmx.quantize(x, fa, axis=1, scale_mode=mode)
    b = jaxmx.quantize(w.T, fb, axis=0, scale_mode=mode)  # K-first [K, N]: transposed to TN
    da, db = decoded(x, fa, 1, mode), decoded(w, fb, 1, mode)
    exact, abs_sum = da @ db.T, np.abs(da) @ np.abs(db).T

    def gemm(backend):
        return lambda a, b: jaxmx.matmul(a, b, jnp.float32, backend=backend)

    native, emulated = gemm("ffi")(a, b), gemm("emulate")(a, b)
    assert_within_bound(native, exact, abs_sum, k)
    assert_within_bound(emulated, exact, abs_sum, k)
    assert "jaxmx_fp8_matmul" in lowered(gemm("ffi"), a, b)


def test_the_per_row_scaling_neither_overflows_nor_underflows_in_between():
    """Rows at 1e30 against columns at 1e-30: 1 / (s_a * s_b) alone would overflow float32."""
    x = np.full((2, 16), 1e30, np.float32)
    x[1] = 3e-38  # a row whose scale is near float32's largest
    w = np.full((3, 16), 1e-30, np.float32)
    w[2, :8] = np.nan  # a NaN row: its scale is NaN, and so its output column
    a, b = (jaxmx.quantize(v, "fp8_e4m3_row", scale_mode="fp32") for v in (x, w))
    got = np.asarray(jaxmx.matmul(a, b, jnp.float32, backend="ffi"))
    da = decoded(x, "fp8_e4m3_row", 1, "fp32")
    db = decoded(w[:2], "fp8_e4m3_row", 1, "fp32")
    assert_within_bound(got[:, :2], da @ db.T, np.abs(da) @ np.abs(db).T, 16)
    assert np.isnan(got[:, 2]).all()
    emulated = np.asarray(jaxmx.matmul(a, b, jnp.float32, backend="emulate"))
    abs_sum = bounds.abs_products(da, db)
    bounds.assert_within(got[:, :2], emulated[:, :2], bounds.between(abs_sum, 16, emulated[:, :2]))
    assert np.isnan(emulated[:, 2]).all()


def test_batch_dims_and_vmap_take_one_scale_pair_per_gemm():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 4, 32)) * np.float32([[[1.0]], [[1e3]], [[1e-3]]])).astype(
        np.float32
    )
    w = rng.standard_normal((3, 8, 32)).astype(np.float32)
    for fmt in ("fp8_e4m3_tensor", "fp8_e4m3_row"):

        def gemm(x, w, backend, fmt=fmt):
            a, b = jaxmx.quantize(x, fmt), jaxmx.quantize(w, fmt)
            return jaxmx.matmul(a, b, jnp.float32, backend=backend)

        mapped = jax.jit(jax.vmap(functools.partial(gemm, backend="ffi")))(x, w)
        for i in range(3):
            da, db = decoded(x[i], fmt, 1, "fp32"), decoded(w[i], fmt, 1, "fp32")
            assert_within_bound(mapped[i], da @ db.T, np.abs(da) @ np.abs(db).T, 32)
        batched = jax.jit(gemm, static_argnums=2)  # batch dims: one scale for the tensor
        native, emulated = (np.asarray(batched(x, w, b), np.float64) for b in ("ffi", "emulate"))
        da, db = (np.asarray(jaxmx.dequantize(jaxmx.quantize(t, fmt)), np.float64) for t in (x, w))
        abs_sum = np.einsum("bmk,bnk->bmn", np.abs(da), np.abs(db))
        bounds.assert_within(native, emulated, bounds.between(abs_sum, 32, emulated), fmt)


# --- the dispatcher -----------------------------------------------------------------------------


def test_auto_runs_per_tensor_and_per_row_fp8_natively_from_compute_capability_8_9(machine):
    for here in (ADA, HOPPER, BLACKWELL, BLACKWELL_12X):
        machine(here)
        for fa, fb in PAIRS:
            gemm = Gemm(formats=(fa, fb), scale_mode="fp32")
            assert kernels(gemm) == {"default": DEQUANTIZED, "cuda": FP8_KERNEL}, (here, fa, fb)
        e5m2 = Gemm(formats=("fp8_e5m2_tensor",) * 2)  # no such cuBLASLt kernel: emulated
        assert kernels(e5m2) == {"default": DEQUANTIZED}
        ffi = Gemm(formats=("fp8_e4m3_row", "fp8_e4m3_row"), backend="ffi")
        assert kernels(ffi) == {"default": FP8_KERNEL}
    machine(AMPERE)  # below 8.9: the emulation
    assert kernels(Gemm(formats=("fp8_e4m3_tensor",) * 2)) == {"default": DEQUANTIZED}
    assert kernels(Gemm(formats=("fp8_e4m3_row",) * 2)) == {"default": DEQUANTIZED}
    assert jaxmx.backends()["native-recipes"].startswith("none")


def test_e5m2_x_e5m2_is_refused_by_name_on_the_native_path():
    x = jnp.ones((4, 32))
    a = jaxmx.quantize(x, "fp8_e5m2_tensor")
    with pytest.raises(NotImplementedError, match="fp8_e5m2_tensor x fp8_e5m2_tensor is not"):
        jaxmx.matmul(a, a, backend="ffi")
    r = recipes.FP8_TENSORWISE.replace(fwd="fp8_e5m2_tensor", backend="ffi")
    with pytest.raises(NotImplementedError, match="fp8_e5m2_tensor x fp8_e5m2_tensor is not"):
        jaxmx.dot_general(x, x, TN, recipe=r)
    mixed = jaxmx.quantize(x, "mxfp8_e4m3")
    with pytest.raises(NotImplementedError, match="b is mxfp8_e4m3, which this native GEMM"):
        jaxmx.matmul(jaxmx.quantize(x, "fp8_e4m3_tensor"), mixed, backend="ffi")


@pytest.mark.cublaslt
@pytest.mark.parametrize("name", ["FP8_TENSORWISE", "FP8_ROWWISE"])
def test_the_cuda_lowering_runs_all_three_gemms_natively_the_forward_with_fast_accumulation(
    machine, name
):
    machine(HOPPER)
    r = getattr(recipes, name)
    x, w, g = jnp.ones((8, 32)), jnp.ones((16, 32)), jnp.ones((8, 16))

    def step(x, w):
        y, pullback = jax.vjp(lambda x, w: jaxmx.dot_general(x, w, TN, recipe=r), x, w)
        return y, *pullback(g)

    calls = [
        line for line in lowered(step, x, w, platforms=("cuda",)).splitlines()
        if "jaxmx_fp8_matmul" in line
    ]  # fmt: skip
    assert len(calls) == 3, calls
    assert ["fast_accum = true" in line for line in calls] == [True, False, False]


# --- the training GEMM --------------------------------------------------------------------------


def ref_gemm(a, fa, a_axis, b, fb, b_axis, mode):
    da, db = decoded(a, fa, a_axis, mode), decoded(b, fb, b_axis, mode)
    return da @ db.T, np.abs(da) @ np.abs(db).T


@pytest.mark.parametrize("k_first", [False, True])  # w [N, K], or stored [K, N] (Flax)
@pytest.mark.parametrize("name", ["FP8_TENSORWISE", "FP8_ROWWISE", "FP8_ROWWISE_GW_HP"])
def test_dot_general_with_backend_ffi_equals_the_emulation_forward_and_gradients(name, k_first):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((8, 24)) * 3).astype(np.float32)
    w = (rng.standard_normal((16, 24)) * 0.1).astype(np.float32)
    g = (rng.standard_normal((8, 16)) * 1e-3).astype(np.float32)
    dims = (((1,), (0,)), ((), ())) if k_first else TN
    w_in = w.T if k_first else w

    def run(backend):
        r = getattr(recipes, name).replace(backend=backend)
        f = functools.partial(jaxmx.dot_general, dimension_numbers=dims, recipe=r)

        @jax.jit
        def step(x, w, g):
            y, pullback = jax.vjp(f, x, w)
            return y, *pullback(g)

        native_gemms = step.lower(x, w_in, g).as_text().count("jaxmx_fp8_matmul")
        assert native_gemms == (0 if backend == "emulate" else 2 if r.wgrad != "quantized" else 3)
        y, dx, dw = step(x, w_in, g)
        return y, dx, dw.T if k_first else dw

    r = getattr(recipes, name)
    mode = r.scale_mode
    refs = [
        ref_gemm(x, r.fwd, 1, w, r.fwd, 1, mode),  # fprop: both along K
        ref_gemm(g, r.grad, 1, w.T, r.fwd, 1, mode),  # dgrad: along N
        ref_gemm(g.T, r.grad, 1, x.T, r.fwd, 1, mode),  # wgrad: along M
    ]
    native, emulated = run("ffi"), run("emulate")
    for i, ((exact, abs_sum), k) in enumerate(zip(refs, (24, 16, 8), strict=True)):
        if i == 2 and r.wgrad == "high_precision":
            exact = g.T.astype(np.float64) @ x  # float32 products and sums: 1 rounding more
            abs_sum = bounds.abs_products(g.T, x.T)
            bounds.assert_within(
                native[2], exact, bounds.against_exact(abs_sum, 8, exact, roundings=1)
            )
        else:
            assert_within_bound(native[i], exact, abs_sum, k)
        assert_within_bound(native[i], np.asarray(emulated[i], np.float64), 2 * abs_sum, k)


def test_a_sharded_dot_general_gives_the_unsharded_result():
    """Under SPMD the per-tensor scales are global (GSPMD reduces the amax over the shards) and
    XLA gathers the operands of the unpartitioned per-tensor FP8 call: the same numbers."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), devices=jax.devices()[:8])
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    w = rng.standard_normal((16, 32)).astype(np.float32)
    r = recipes.FP8_TENSORWISE.replace(backend="ffi")

    def loss(x, w):
        return jaxmx.dot_general(x, w, TN, recipe=r).sum()

    step = jax.jit(jax.value_and_grad(loss, (0, 1)))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
    sharded = step(jax.device_put(x, sharding), jax.device_put(w, sharding))
    whole = step(x, w)
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(whole), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# --- the cuBLASLt core against its test double --------------------------------------------------


@pytest.fixture(scope="module")
def double(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("cublaslt_double_fp8")))


@pytest.mark.cublaslt
def test_the_double_refuses_what_cublaslt_refuses_and_takes_the_prepared_operands(double):
    gpu = Machine(double, (89,))
    try:
        e4, e5 = "float8_e4m3fn", "float8_e5m2"
        per_tensor = dict(mx=False, scaling=0)
        assert plain_matmul(double, 16, 16, 32, (e5, e5), **per_tensor) == (
            "CUBLAS_STATUS_NOT_SUPPORTED"
        )
        assert plain_matmul(double, 16, 16, 40, (e4, e5), **per_tensor) == (
            "CUBLAS_STATUS_NOT_SUPPORTED"
        )
        assert gpu.refusal() == "K is not a multiple of the block"
        for trans in [(0, 0), (1, 1), (0, 1)]:
            assert plain_matmul(double, 16, 16, 32, (e4, e4), trans, **per_tensor) == (
                "CUBLAS_STATUS_NOT_SUPPORTED"
            )
            assert gpu.refusal() == "only TN on this architecture"
        # what the native per-tensor / per-row GEMM hands cuBLASLt for a K-first K = 40 operand
        rng = np.random.default_rng(6)
        x = rng.standard_normal((40, 4)).astype(np.float32)  # [K, M], quantized along K
        w = rng.standard_normal((16, 40)).astype(np.float32)
        a = jaxmx.quantize(x, "fp8_e4m3_tensor", axis=0)
        b = jaxmx.quantize(w, "fp8_e5m2_row", axis=1)
        a_codes, b_codes = (np.asarray(tn_codes(q))[None] for q in (a, b))
        assert a_codes.shape == (1, 4, 48) and b_codes.shape == (1, 16, 48)
        one = placed(np.float32([1.0]))
        d = placed(np.full((1, 4, 16), np.nan, np.float32))
        assert gpu.gemm(placed(a_codes), placed(b_codes), one, one, d, mx=False) == ("ok", "")
        (call,) = gpu.matmuls()
        assert (call.transa, call.transb) == (1, 0)
        ca = ref.current_fp8(x.T, "fp8_e4m3_tensor", 1)[0].astype(np.float64)
        cb = ref.current_fp8(w, "fp8_e5m2_row", 1)[0].astype(np.float64)
        assert_within_bound(d[0], ca @ cb.T, np.abs(ca) @ np.abs(cb).T, 40)
    finally:
        gpu.close()
