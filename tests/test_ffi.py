"""The native GEMM (jaxmx.ffi and the jaxmx._ffi extension), checked on the CPU handler.

The reference here is numpy + ml_dtypes only: fp8 codes decoded by ml_dtypes, scales as
2.0 ** (byte - 127), a float64 GEMM. The swizzle offsets (the cuBLAS layout) come from
``swizzle_offset`` in tests/reference.py.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import importlib.machinery
import importlib.util
import os
import site
import subprocess
import sys
import sysconfig
import typing

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference as ref
import typing_extensions

import jaxmx
from jaxmx import MXArray, _ffi, ffi
from jaxmx._src.gemm import capabilities
from jaxmx._src.gemm.capabilities import native_pair

E4M3, E5M2 = "mxfp8_e4m3", "mxfp8_e5m2"
FP8_DTYPE = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}
OUT_EPS = {jnp.float32: 0.0, jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11}
OUT_TINY = {jnp.float32: 0.0, jnp.bfloat16: 2.0**-133, jnp.float16: 2.0**-24}

# One compile per shape instead of one per primitive (eager quantize is slow to warm up).
quantize = jax.jit(jaxmx.quantize, static_argnames=("fmt", "axis"))


# --- reference --------------------------------------------------------------------------------


def decode_mx(q: MXArray) -> np.ndarray:
    """float64 values of an MXArray's padded data, without jaxmx code."""
    codes = np.asarray(q.data).astype(np.float64)
    byte = np.asarray(q.scale).view(np.uint8).astype(np.float64)
    scale = np.where(byte == 255, np.nan, 2.0 ** (byte - 127))
    return codes * np.repeat(scale, 32, axis=-1)


def ref_mx_matmul(a: MXArray, b: MXArray):
    """(float64 GEMM, float64 sum of |products|) over the padded operands."""
    x, y = decode_mx(a), decode_mx(b)
    return np.einsum("...mk,...nk->...mn", x, y), np.einsum("...mk,...nk->...mn", abs(x), abs(y))


def assert_gemm_close(out, exact, abs_sum, k, out_dtype):
    """|out - exact| within float32 summation over the K-blocks plus the output rounding."""
    out = np.asarray(out).astype(np.float64)
    blocks = -(-k // 32)
    tol = (blocks + 2) * 2.0**-24 * abs_sum + OUT_EPS[out_dtype] * np.abs(exact)
    tol += OUT_TINY[out_dtype] + blocks * 2.0**-149  # float32 underflow of each block's sum
    err = np.abs(out - exact)
    bad = ~(err <= tol)
    assert not bad.any(), (
        f"{bad.sum()} of {bad.size} entries off; worst err {err[bad].max()} tol {tol[bad].min()}"
    )


def random_mx(key, shape, fmt, spread=8):
    """Quantized normal data whose rows span 2^-spread .. 2^spread (so scales vary)."""
    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, shape, jnp.float32)
    x = x * 2.0 ** jax.random.randint(k2, (*shape[:-1], 1), -spread, spread + 1)
    return quantize(x, fmt)


def random_codes_mx(rng, rows, k, fmt, byte_range=(110, 140)):
    """An MXArray of random finite codes (every code of the format occurs) and random scale
    bytes, K zero-padded to a multiple of 32 like MXArray does."""
    dtype = FP8_DTYPE[fmt]
    kp = -(-k // 32) * 32
    codes = rng.integers(0, 256, (rows, kp), dtype=np.uint8)
    finite = np.isfinite(codes.view(dtype).astype(np.float32))
    codes = np.where(finite, codes, 0).astype(np.uint8)
    codes[:, k:] = 0
    scale = rng.integers(*byte_range, (rows, kp // 32), dtype=np.uint8)
    return MXArray(
        jnp.asarray(codes.view(dtype)),
        jnp.asarray(scale.view(ml_dtypes.float8_e8m0fnu)),
        fmt,
        1,
        (rows, k),
    )


# --- the GEMM against numpy ---------------------------------------------------------------------

SHAPES = [  # (M, N, K): M/N not multiples of 128, K not a multiple of 32, M = 1
    (1, 1, 1),
    (1, 17, 40),
    (5, 3, 32),
    (7, 130, 100),
    (130, 9, 64),
    (33, 70, 257),
]


# Scale bytes per output dtype keep float16 results finite (|value| < 65504).
BYTES = {jnp.float32: (100, 150), jnp.bfloat16: (90, 160), jnp.float16: (100, 112)}


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize(
    "fmts,out_dtype",
    [
        ((E4M3, E4M3), jnp.float32),
        ((E4M3, E5M2), jnp.bfloat16),
        ((E5M2, E4M3), jnp.float16),
    ],
)
def test_mx_matmul_matches_numpy(m, n, k, fmts, out_dtype):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a = random_codes_mx(rng, m, k, fmts[0], BYTES[out_dtype])
    b = random_codes_mx(rng, n, k, fmts[1], BYTES[out_dtype])
    out = ffi.mx_matmul(a, b, out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    exact, abs_sum = ref_mx_matmul(a, b)
    assert_gemm_close(out, exact, abs_sum, k, out_dtype)


def test_quantized_operands_match_numpy():
    """Real quantize() output: rows spanning 2^-8..2^8, K = 100 padded to 128, E4M3 x E5M2."""
    a = random_mx(jax.random.key(0), (37, 100), E4M3)
    b = random_mx(jax.random.key(1), (45, 100), E5M2)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        exact, abs_sum = ref_mx_matmul(a, b)
        assert_gemm_close(ffi.mx_matmul(a, b, out_dtype), exact, abs_sum, 100, out_dtype)


@pytest.mark.parametrize("fmts", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
def test_all_scale_bytes(fmts):
    rng = np.random.default_rng(1)
    a = random_codes_mx(rng, 19, 96, fmts[0], (0, 171))  # 2^-127..2^43
    b = random_codes_mx(rng, 45, 96, fmts[1], (0, 171))
    exact, abs_sum = ref_mx_matmul(a, b)
    assert_gemm_close(ffi.mx_matmul(a, b, jnp.float32), exact, abs_sum, 96, jnp.float32)


def test_e5m2_x_e5m2_is_refused_as_cublaslt_refuses_it():
    """cuBLASLt's FP8 type table has no E5M2 x E5M2: the native GEMM refuses it everywhere,
    the C++ handler too, and "auto" emulates such a GEMM instead."""
    a = random_mx(jax.random.key(0), (8, 64), E5M2)
    with pytest.raises(NotImplementedError, match="E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3"):
        ffi.mx_matmul(a, a)
    with pytest.raises(NotImplementedError, match="mxfp8_e5m2 x mxfp8_e5m2"):
        jaxmx.matmul(a, a, jnp.float32, backend="ffi")
    swizzled = jaxmx.swizzle_scales(a.scale)
    with pytest.raises(Exception, match="float8_e5m2 x float8_e5m2 is not supported"):
        raw_call("jaxmx_mx_matmul", (8, 8), jnp.float32, a.data, a.data, swizzled, swizzled)

    assert not native_pair((E5M2, E5M2))
    assert native_pair((E5M2, E4M3)) and native_pair((E4M3, E4M3))


def test_one_block_e4m3_is_exact_then_rounded_once():
    """K = 32, E4M3: the block sum is exact, so float32 output == float32(exact)."""
    rng = np.random.default_rng(2)
    a = random_codes_mx(rng, 40, 32, E4M3, (100, 160))
    b = random_codes_mx(rng, 50, 32, E4M3, (100, 160))
    exact, _ = ref_mx_matmul(a, b)
    out = np.asarray(ffi.mx_matmul(a, b, jnp.float32))
    np.testing.assert_array_equal(out, exact.astype(np.float32))


def test_subnormal_results_are_kept():
    """Scales near 2^-127 give float32-subnormal results; the handler must not flush them."""
    a = MXArray(
        jnp.ones((2, 32), jnp.float8_e4m3fn),
        jnp.asarray(np.full((2, 1), 2, np.uint8).view(ml_dtypes.float8_e8m0fnu)),
        E4M3,
        1,
        (2, 32),
    )
    out = np.asarray(ffi.mx_matmul(a, a, jnp.float32))  # 32 * 2^-125 * 2^-125 = 2^-245 -> 0
    assert (out == 0).all()
    b = MXArray(
        a.data, jnp.asarray(np.full((2, 1), 100, np.uint8).view(a.scale.dtype)), E4M3, 1, a.shape
    )
    out = np.asarray(ffi.mx_matmul(a, b, jnp.float32))  # 32 * 2^-125 * 2^-27 = 2^-147
    assert out[0, 0] == np.float32(2.0**-147) and out[0, 0] > 0


def test_nan_scale_and_nan_code_propagate():
    x = np.ones((3, 64), np.float32)
    x[1, 5] = np.nan  # row 1, block 0 gets the NaN scale
    a = quantize(jnp.asarray(x))
    b = quantize(jnp.ones((4, 64)))
    out = np.asarray(ffi.mx_matmul(a, b, jnp.float32))
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all()
    np.testing.assert_array_equal(out[0], 64.0)


def test_per_tensor_fp8_matches_numpy():
    rng = np.random.default_rng(3)
    for (m, n, k), (ta, tb), out_dtype, sa in [
        ((9, 21, 48), (E4M3, E4M3), jnp.float32, 2.0**-3),
        ((1, 40, 16), (E4M3, E5M2), jnp.bfloat16, 2.0**-3),
        ((33, 5, 80), (E5M2, E4M3), jnp.float16, 2.0**-20),
    ]:
        a = random_codes_mx(rng, m, 96, ta).data[:, :k]
        b = random_codes_mx(rng, n, 96, tb).data[:, :k]
        sa, sb = np.float32(sa), np.float32(0.75)
        out = ffi.fp8_matmul(a, b, sa, sb, out_dtype)
        x = np.asarray(a).astype(np.float64) * float(sa)
        y = np.asarray(b).astype(np.float64) * float(sb)
        exact = x @ y.T
        assert_gemm_close(out, exact, np.abs(x) @ np.abs(y).T, k, out_dtype)


def test_fast_accum_reaches_the_custom_call_and_the_cpu_ignores_it():
    x = random_codes_mx(np.random.default_rng(6), 4, 32, E4M3).data
    fast = jax.jit(lambda a: ffi.fp8_matmul(a, a, 1.0, 0.5, jnp.float32, fast_accum=True))
    assert "fast_accum = true" in fast.lower(x).as_text()
    np.testing.assert_array_equal(fast(x), ffi.fp8_matmul(x, x, 1.0, 0.5, jnp.float32))
    plain = jax.jit(lambda a: ffi.fp8_matmul(a, a, 1.0, 0.5, jnp.float32))
    assert "fast_accum = false" in plain.lower(x).as_text()


def test_per_tensor_fp8_batched_scales_and_vmap():
    rng = np.random.default_rng(4)
    a = jnp.stack([random_codes_mx(rng, 6, 32, E4M3).data for _ in range(3)])
    b = jnp.stack([random_codes_mx(rng, 10, 32, E4M3).data for _ in range(3)])
    sa = jnp.asarray([1.0, 0.5, 2.0], jnp.float32)
    out = ffi.fp8_matmul(a, b, sa, 3.0, jnp.float32)
    looped = jnp.stack([ffi.fp8_matmul(a[i], b[i], sa[i], 3.0, jnp.float32) for i in range(3)])
    vmapped = jax.vmap(lambda x, y, s: ffi.fp8_matmul(x, y, s, 3.0, jnp.float32))(a, b, sa)
    np.testing.assert_array_equal(out, looped)
    np.testing.assert_array_equal(vmapped, looped)


# --- jit, vmap, HLO -------------------------------------------------------------------------------


def test_jit_hlo_contains_the_custom_call():
    a = random_mx(jax.random.key(0), (8, 64), E4M3)
    b = random_mx(jax.random.key(1), (16, 64), E4M3)
    f = jax.jit(lambda a, b: ffi.mx_matmul(a, b, jnp.bfloat16))
    lowered = f.lower(a, b)
    assert "jaxmx_mx_matmul" in lowered.as_text()
    assert "jaxmx_mx_matmul" in lowered.compile().as_text()
    np.testing.assert_array_equal(f(a, b), ffi.mx_matmul(a, b, jnp.bfloat16))
    g = jax.jit(lambda x, y: ffi.fp8_matmul(x, y, 1.0, 1.0))
    assert "jaxmx_fp8_matmul" in g.lower(a.data, b.data).as_text()


def test_batch_dims_and_vmap_agree_with_single_calls():
    key = jax.random.split(jax.random.key(5), 2)
    x = jax.random.normal(key[0], (3, 20, 64))
    w = jax.random.normal(key[1], (3, 24, 64))
    qx, qw = quantize(x), quantize(w)
    single = [ffi.mx_matmul(quantize(x[i]), quantize(w[i]), jnp.float32) for i in range(3)]
    single = np.stack(single)
    np.testing.assert_array_equal(
        ffi.mx_matmul(qx, qw, jnp.float32), single
    )  # [B, M, K] x [B, N, K]
    mm = lambda p, q: ffi.mx_matmul(p, q, jnp.float32)
    np.testing.assert_array_equal(jax.jit(jax.vmap(mm))(qx, qw), single)
    # lhs batched, rhs shared (folded into M); rhs batched, lhs shared (broadcast)
    q0 = quantize(w[0])
    ref_l = np.stack([mm(quantize(x[i]), q0) for i in range(3)])
    np.testing.assert_array_equal(jax.vmap(mm, in_axes=(0, None))(qx, q0), ref_l)
    ref_r = np.stack([mm(q0, quantize(x[i])) for i in range(3)])
    np.testing.assert_array_equal(jax.vmap(mm, in_axes=(None, 0))(q0, qx), ref_r)
    # nested vmap over a [2, 3, ...] batch
    qx2 = jax.tree.map(lambda t: jnp.stack([t, t]), qx)
    qw2 = jax.tree.map(lambda t: jnp.stack([t, t]), qw)
    nested = jax.vmap(jax.vmap(mm))(qx2, qw2)
    np.testing.assert_array_equal(nested, np.stack([single, single]))


# --- the swizzled layout read by C++ ------------------------------------------------------------


@pytest.mark.parametrize("rows,cols", [(1, 1), (2, 3), (128, 4), (129, 5), (300, 9)])
def test_cpp_unswizzle_matches_design_formula(rows, cols):
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    buf = np.random.default_rng(rows * cols).integers(0, 256, rp * cp, dtype=np.uint8)
    r, c = np.indices((rows, cols))
    expect = buf[ref.swizzle_offset(r, c, cols)]  # the cuBLAS layout, index by index
    np.testing.assert_array_equal(_ffi.unswizzle_scales(buf, rows, cols), expect)
    # and the JAX swizzle is its inverse
    s = jnp.asarray(expect)
    np.testing.assert_array_equal(
        _ffi.unswizzle_scales(np.asarray(jaxmx.swizzle_scales(s)), rows, cols), expect
    )


def test_cpp_unswizzle_rejects_wrong_size():
    with pytest.raises(ValueError, match="has 512 bytes"):
        _ffi.unswizzle_scales(np.zeros(100, np.uint8), 2, 3)


EMPTY_UNSWIZZLES = """
import numpy as np
from jaxmx import _ffi
for rows, cols in ((2**62, 0), (0, 2**62 - 4), (0, 0)):
    print(_ffi.unswizzle_scales(np.zeros(0, np.uint8), rows, cols).shape)
"""


def test_cpp_unswizzle_of_an_empty_matrix_returns_at_once():
    """2^62 rows of no columns fit a 0-byte buffer: an empty result, not a loop over the rows
    (in a subprocess, so that a hang fails the test instead of stalling the suite)."""
    run = subprocess.run(
        [sys.executable, "-c", EMPTY_UNSWIZZLES], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:3] == [f"({2**62}, 0)", f"(0, {2**62 - 4})", "(0, 0)"]


# --- errors: Python side ------------------------------------------------------------------------


def test_python_side_errors():
    a = quantize(jnp.ones((4, 64)))
    with pytest.raises(TypeError, match="expected an MXArray"):
        ffi.mx_matmul(jnp.ones((4, 64)), a)
    with pytest.raises(NotImplementedError, match=r"mxfp4.*not support"):
        ffi.mx_matmul(quantize(jnp.ones((4, 64)), "mxfp4"), a)
    with pytest.raises(ValueError, match="contracting sizes differ"):
        ffi.mx_matmul(a, quantize(jnp.ones((4, 96))))
    with pytest.raises(ValueError, match=r"last axis \(TN form\) or \[..., K, rows\]"):
        ffi.mx_matmul(quantize(jnp.ones((64, 4, 32)), axis=0), a)  # K-first takes axis -2
    with pytest.raises(ValueError, match="batch dimensions differ"):
        ffi.mx_matmul(quantize(jnp.ones((2, 4, 64))), quantize(jnp.ones((3, 4, 64))))
    with pytest.raises(TypeError, match="out_dtype"):
        ffi.mx_matmul(a, a, jnp.int32)
    odd = (jnp.zeros((4, 40), jnp.float8_e4m3fn), a.scale)
    with pytest.raises(ValueError, match=r"mx_matmul: a: .* holds codes of shape \(4, 64\)"):
        ffi.mx_matmul(jax.tree.unflatten(jax.tree.structure(a), odd), a)  # K padded to 64
    with pytest.raises(ValueError, match=r"holds codes of shape \(4, 64\)"):
        MXArray(*odd, E4M3, 1, (4, 40))
    with pytest.raises(TypeError, match="holds float8_e4m3fn codes, got float8_e5m2"):
        MXArray(a.data.astype(jnp.float8_e5m2), a.scale, E4M3, 1, (4, 64))
    x8 = jnp.ones((4, 32), jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        ffi.fp8_matmul(jnp.ones((4, 32)), x8, 1.0, 1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        ffi.fp8_matmul(x8[:, :24], x8[:, :24], 1.0, 1.0)
    with pytest.raises(TypeError, match="e5m2 x float8_e5m2"):
        e5 = x8.astype(jnp.float8_e5m2)
        ffi.fp8_matmul(e5, e5, 1.0, 1.0)
    with pytest.raises(ValueError, match="scalar or have the batch shape"):
        ffi.fp8_matmul(x8, x8, jnp.ones(3), 1.0)


# --- errors: C++ side (raw ffi_call, no Python checks) -------------------------------------------


def raw_call(target, out_shape, out_dtype, *args):
    ffi.register_targets()
    attributes = {
        "jaxmx_fp8_matmul": {"fast_accum": False},
        "jaxmx_mx_matmul": {"lhs_k_first": False, "rhs_k_first": False},
    }.get(target, {})
    out, _ = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct(out_shape, out_dtype), jax.ShapeDtypeStruct((0,), jnp.uint8)),
    )(*args, **attributes)
    return np.asarray(out)


def test_cpp_side_errors():
    e4 = jnp.zeros((4, 64), jnp.float8_e4m3fn)
    s = jnp.zeros((256,), jnp.uint8)  # roundup(4, 128) * roundup(2, 4) = 512 expected
    s_ok = jnp.zeros((512,), jnp.uint8)
    mx = "jaxmx_mx_matmul"
    assert raw_call(mx, (4, 4), jnp.float32, e4, e4, s_ok, s_ok).shape == (4, 4)
    cases = [
        (
            (jnp.zeros((4, 64)), e4, s_ok, s_ok),
            (4, 4),
            "lhs must be float8_e4m3fn or .* got float32",
        ),
        ((e4, e4.astype(jnp.int8), s_ok, s_ok), (4, 4), "rhs must be .* got int8"),
        ((e4, e4, s, s_ok), (4, 4), r"lhs scales must be the swizzled \[..., 512\] bytes"),
        ((e4, e4, s_ok, s_ok.astype(jnp.float32)), (4, 4), "rhs scales must be uint8"),
        (
            (e4, jnp.zeros((4, 96), jnp.float8_e4m3fn), s_ok, s_ok),
            (4, 4),
            "contracting sizes differ",
        ),
        ((e4[:, :40], e4[:, :40], s_ok, s_ok), (4, 4), "K must be a multiple of 32"),
        ((e4, e4, s_ok, s_ok), (4, 5), r"the output must have shape \[..., 4, 4\]"),
        ((e4[None], e4[None], s_ok[None], s_ok[None]), (4, 4), "lhs .* must have the same rank"),
    ]
    for args, shape, msg in cases:
        with pytest.raises(Exception, match=f"{mx}: {msg}"):
            raw_call(mx, shape, jnp.float32, *args)
    with pytest.raises(Exception, match="the output must be bfloat16, float16 or float32"):
        raw_call(mx, (4, 4), jnp.int32, e4, e4, s_ok, s_ok)
    with pytest.raises(Exception, match="jaxmx_fp8_matmul: lhs scale must hold one float32"):
        raw_call("jaxmx_fp8_matmul", (4, 4), jnp.float32, e4, e4, jnp.ones(2), jnp.ones(()))
    with pytest.raises(Exception, match="jaxmx_fp8_matmul: rhs scale must be float32"):
        raw_call("jaxmx_fp8_matmul", (4, 4), jnp.float32, e4, e4, jnp.ones(()), s_ok)


# --- backends and the build ---------------------------------------------------------------------


@pytest.fixture
def no_handler(machine):
    """The native GEMM lowered for a machine where some platforms have no handler, with a
    recognisable reason.

    Shapes used under it are not used elsewhere, and the caches are cleared after it, so no
    trace made without the handler is reused.
    """

    def assume(*platforms):
        missing = tuple((p, f"no handler here ({p}, test)") for p in platforms)
        machine(dataclasses.replace(capabilities.current(), missing_handlers=missing))

    yield assume
    jax.clear_caches()


def test_platform_without_handler_raises_a_clear_error(no_handler):
    """Like a CUDA machine whose extension was built without cuBLASLt, on this CPU machine."""
    no_handler("cpu")
    a = random_mx(jax.random.key(0), (3, 96), E4M3)
    b = random_mx(jax.random.key(1), (5, 96), E5M2)
    want = r"mx_matmul: .*no handler for platform 'cpu' \(cpu: no handler here \(cpu, test\)\)"
    with pytest.raises(RuntimeError, match=want):
        ffi.mx_matmul(a, b)
    with pytest.raises(RuntimeError, match=want):
        jax.jit(lambda a, b: ffi.mx_matmul(a, b, jnp.float32))(a, b)
    x = jnp.ones((3, 48), jnp.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"fp8_matmul: .*no handler here \(cpu, test\)"):
        ffi.fp8_matmul(x, x[:2], 1.0, 1.0)


def test_lowering_for_a_platform_without_handler(no_handler):
    """Only the platforms lowered for matter: CPU still works; CUDA and TPU fail readably."""
    a = random_mx(jax.random.key(0), (7, 96), E4M3)
    b = random_mx(jax.random.key(1), (9, 96), E4M3)
    f = jax.jit(lambda a, b: ffi.mx_matmul(a, b))
    with pytest.raises(RuntimeError, match="handlers for CPU and CUDA only, not tpu"):
        f.trace(a, b).lower(lowering_platforms=("tpu",))
    no_handler("cuda")
    a = random_mx(jax.random.key(0), (11, 96), E4M3)  # shapes not traced before the patch
    b = random_mx(jax.random.key(1), (13, 96), E4M3)
    traced = jax.jit(lambda a, b: ffi.mx_matmul(a, b)).trace(a, b)
    assert "jaxmx_mx_matmul" in traced.lower(lowering_platforms=("cpu",)).as_text()
    with pytest.raises(RuntimeError, match=r"platform 'cuda' \(cuda: no handler here"):
        traced.lower(lowering_platforms=("cpu", "cuda"))


def _site_dirs():
    dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    dirs.update(site.getsitepackages())
    dirs.add(site.getusersitepackages())
    return sorted(d for d in dirs if os.path.isdir(d))


@pytest.mark.cublaslt
@pytest.mark.skipif(
    os.environ.get("JAXMX_CUDA", "").upper() not in ("ON", "1", "TRUE"),
    reason="the cuBLASLt handler is built with JAXMX_CUDA=ON (as CI does)",
)
def test_cuda_handler_built_when_asked_for():
    """CI builds with JAXMX_CUDA=ON, so a CUDA compile error cannot pass unnoticed."""
    info = _ffi.build_info()
    assert info["has_cuda"] == _ffi.has_cuda
    assert _ffi.has_cuda, "JAXMX_CUDA=ON but the extension has no cuBLASLt handler"
    assert info["cublas_header_version"] >= 120800
    cuda = _ffi.registrations()["CUDA"]
    for target in ("jaxmx_mx_matmul", "jaxmx_fp8_matmul"):  # setup outside graph capture
        assert set(cuda[target]) == {"initialize", "execute"}, target


@pytest.mark.cublaslt
def test_cuda_libraries_resolve_when_installed():
    """dlopen + dlsym of every cuBLASLt / CUDA runtime function the handler uses (no GPU needed)."""
    libs = [
        p
        for d in _site_dirs()
        for p in glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcublasLt.so*"))
    ]
    if not libs:
        pytest.skip("no libcublasLt wheel installed")
    info = _ffi.cuda_libraries()
    assert info["loaded"], info["error"]
    assert info["cublaslt_version"] >= 120800
    assert info["cudart_version"] > 0


def test_sizes_that_overflow_64_bits_are_refused():
    """2^62 rows of scales: the padded size wraps in int64; refused, not read past a buffer."""
    with pytest.raises(ValueError, match="overflows 64 bits"):
        _ffi.unswizzle_scales(np.zeros(0, np.uint8), 2**62, 4)
    with pytest.raises(ValueError, match="overflows 64 bits"):
        _ffi.unswizzle_scales(np.zeros(0, np.uint8), 2**40, 2**40)


PEAK_SCRIPT = """
import resource, sys
import jax.numpy as jnp, jaxmx
from jaxmx import ffi
from jaxmx._src.gemm.capabilities import native_pair
a = jaxmx.quantize(jnp.ones((1, 2**20)))
jaxmx.matmul(a, a, jnp.float32, backend=sys.argv[1]).block_until_ready()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_the_cpu_handler_memory_is_bounded_by_tiles():
    """M = N = 1, K = 2^20 (1 MiB of codes per operand): the handler's working memory is a few
    tiles, not a float64 copy of a 64-row panel of K (512 MiB). Peak memory of the same program
    on the native backend and on the emulation, each in a fresh process."""

    def peak_mib(backend: str) -> float:
        out = subprocess.run(
            [sys.executable, "-c", PEAK_SCRIPT, backend],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        return int(out.stdout.split()[-1]) / 1024  # ru_maxrss is in KiB on Linux

    extra = peak_mib("ffi") - peak_mib("emulate")
    assert extra < 64, f"the CPU handler's peak is {extra:.0f} MiB above the emulation's"


def test_the_cuda_workspace_handed_to_cublaslt_is_256_byte_aligned():
    """cuBLASLt needs a 256-byte aligned workspace; XLA's buffer may start anywhere. The custom
    call asks for 256 extra bytes and the handler passes on an aligned part of a fixed size."""
    size = ffi.WORKSPACE_BYTES + 256
    for address in range(0x1000, 0x1000 + 512, 8):
        offset, usable = _ffi.align_workspace(address, size)
        assert (address + offset) % 256 == 0
        assert usable == ffi.WORKSPACE_BYTES and offset + usable <= size
    assert _ffi.align_workspace(0x1008, 100) == (0, 0)  # too small to align: no workspace


@pytest.mark.cublaslt
def test_the_cuda_lowering_asks_for_the_workspace_and_its_alignment_slack():
    size = ffi.WORKSPACE_BYTES + 256
    a = quantize(jnp.ones((4, 64)))
    text = jax.jit(ffi.mx_matmul).trace(a, a).lower(lowering_platforms=("cuda",)).as_text()
    assert f"tensor<{size}xui8>" in text


# --- the type stub jaxmx/_ffi.pyi -----------------------------------------------------------

CUDA_ONLY_NAMES = {"cuda_libraries"}  # defined by a build with cuBLASLt only (ffi/module.cc)


def _stub_path() -> str:
    """The stub in the jaxmx package: beside the compiled module in a wheel, in the source tree
    of an editable install (where the compiled module lives in site-packages)."""
    return os.path.join(os.path.dirname(jaxmx.__file__), "_ffi.pyi")


def _load_stub():
    """The stub executed as a module: its TypedDicts become classes with their key sets."""
    loader = importlib.machinery.SourceFileLoader("jaxmx_ffi_stub", _stub_path())
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def _stub_exports() -> set[str]:
    """What the stub declares the module exports: its functions and annotated attributes (not
    its TypedDicts, which exist for type checkers only)."""
    with open(_stub_path()) as f:
        tree = ast.parse(f.read())
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    names |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    return names


def _assert_keys_match(value, typed_dict, where: str) -> None:
    """``value``'s keys are the TypedDict's (its required ones all there, no others), and so
    are those of every nested dict the TypedDict types as a TypedDict."""
    keys = set(value)
    assert typed_dict.__required_keys__ <= keys, (where, typed_dict.__required_keys__ - keys)
    allowed = typed_dict.__required_keys__ | typed_dict.__optional_keys__
    assert keys <= allowed, f"{where}: keys the stub does not declare: {sorted(keys - allowed)}"
    hints = typing.get_type_hints(typed_dict)
    for key, item in value.items():
        if typing_extensions.is_typeddict(hints[key]):
            _assert_keys_match(item, hints[key], f"{where}[{key!r}]")


def test_the_stub_declares_what_the_module_exports():
    compiled = {n for n in dir(_ffi) if not n.startswith("_")}
    declared = _stub_exports()
    expected = declared if _ffi.has_cuda else declared - CUDA_ONLY_NAMES
    assert compiled == expected, (
        f"only in the module: {sorted(compiled - expected)}; "
        f"only in the stub: {sorted(expected - compiled)}"
    )


def test_the_dicts_the_module_returns_have_the_stub_keys():
    stub = _load_stub()
    _assert_keys_match(_ffi.registrations(), stub.Registrations, "registrations()")
    _assert_keys_match(_ffi.build_info(), stub.BuildInfo, "build_info()")
    cuda_keys = {k for k in stub.BuildInfo.__optional_keys__ if k.startswith("cu")}
    present = cuda_keys & set(_ffi.build_info())
    assert present == (cuda_keys if _ffi.has_cuda else set()), present
    assert ("CUDA" in _ffi.registrations()) == _ffi.has_cuda
    if _ffi.has_cuda:
        _assert_keys_match(_ffi.cuda_libraries(), stub.CudaLibraries, "cuda_libraries()")
