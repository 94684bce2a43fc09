"""The native FP4 GEMM (``jaxmx.ffi.fp4_matmul``, custom call ``jaxmx_fp4_matmul``) on its CPU
handler, bit for bit against a numpy + ml_dtypes reference of its semantics written here:

    out = out_dtype(float32(alpha * acc)),  alpha = float32(g_a * g_b) (NVFP4) or 1 (MXFP4),

where ``acc`` adds, block after block along K in float32, each block's exact sum of
``(code_a * s_a) * (code_b * s_b)`` (s: the E4M3 block scale of NVFP4, or 2^(byte - 127) for the
E8M0 scale of MXFP4; a NaN scale gives NaN). The reference reads the MXArray fields directly
(codes, compact scales, tiles, global scales), never jaxmx's own GEMM code.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from machines import BLACKWELL, HOPPER

import jaxmx
from jaxmx import ffi
from jaxmx._src.gemm.capabilities import native_family
from jaxmx._src.gemm.dequantized_matmul import DEQUANTIZED
from jaxmx._src.gemm.dispatch import Gemm, kernels
from jaxmx._src.gemm.emulate import EMULATE
from jaxmx._src.gemm.native import FP4_KERNEL

BLOCK = {"nvfp4": 16, "mxfp4": 32}
OUT = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


# --- the reference ------------------------------------------------------------------------------


def row_scales(q, rows: int) -> np.ndarray:
    """float64 [..., rows, K-blocks] of ``q``'s block scales (tile scales repeated over rows)."""
    if q.fmt == "nvfp4":
        s = np.asarray(q.scale).astype(np.float64)  # E4M3: NaN for 0x7F / 0xFF
    else:
        e = np.asarray(q.scale).view(np.uint8).astype(np.float64)
        s = np.where(e == 255, np.nan, 2.0 ** (e - 127))
    if q.tile is not None:
        s = np.repeat(s, q.tile[0], axis=-2)
    return s[..., :rows, :]


def reference(a, b, out_dtype: str, g_a=None, g_b=None) -> np.ndarray:
    """The FP4 GEMM of TN operands a [..., M, K], b [..., N, K] (MXArrays, equal batch dims);
    ``g_a`` / ``g_b`` override the NVFP4 tensor scales (float32 arrays over the batch dims)."""
    block, k = BLOCK[a.fmt], a.shape[-1]
    m, n = a.shape[-2], b.shape[-2]
    x = np.asarray(a.data)[..., :m, :].astype(np.float64)
    y = np.asarray(b.data)[..., :n, :].astype(np.float64)
    x[..., k:] = 0.0  # padding codes count as zero whatever they hold
    y[..., k:] = 0.0
    sa, sb = row_scales(a, m), row_scales(b, n)
    batch = x.shape[:-2]
    acc = np.zeros((*batch, m, n), np.float32)
    for c in range(x.shape[-1] // block):
        part = slice(c * block, (c + 1) * block)
        exact = np.einsum("...mk,...nk->...mn", x[..., part], y[..., part])
        with np.errstate(invalid="ignore"):
            value = exact * sa[..., :, c, None] * sb[..., None, :, c]
        acc = (acc + value.astype(np.float32)).astype(np.float32)
    if a.fmt == "nvfp4":
        g_a = np.asarray(a.global_scale if g_a is None else g_a, np.float32)
        g_b = np.asarray(b.global_scale if g_b is None else g_b, np.float32)
        alpha = np.broadcast_to(g_a * g_b, batch).astype(np.float32)  # float32 product
    else:
        alpha = np.ones(batch, np.float32)
    return (alpha[..., None, None] * acc).astype(np.float32).astype(OUT[out_dtype])


def at(q, i):
    """Element ``i`` of a vmapped (stacked) MXArray."""
    return jax.tree.map(lambda t: t[i], q)


def assert_bits_equal(got, want):
    """Equal bit patterns, NaN wherever the other is NaN (NaN payloads aside)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    uint = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    np.testing.assert_array_equal(got.view(uint)[~nan], want.view(uint)[~nan])


def operand(seed, shape, fmt, rows=(-6, 7), **kwargs):
    """``fmt``-quantized normal values, rows (2^rows) and elements spanning a few binades."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, shape)
    x = x * 2.0 ** jax.random.randint(k2, (*shape[:-1], 1), *rows)
    x = x * 2.0 ** jax.random.randint(k3, shape, -3, 4)
    return jaxmx.quantize(x, fmt, **kwargs)


# --- numerics -----------------------------------------------------------------------------------

CASES = [  # fmt, a shape, N, out dtype
    ("nvfp4", (4, 64), 16, "float32"),
    ("nvfp4", (2, 3, 40), 7, "bfloat16"),  # batch dims; K = 40: 48 in blocks, 64 in the call
    ("nvfp4", (130, 16), 33, "float16"),
    ("mxfp4", (5, 96), 24, "float32"),
    ("mxfp4", (3, 2, 50), 9, "bfloat16"),  # K = 50: 64 in blocks
    ("mxfp4", (1, 32), 1, "float16"),
]


@pytest.mark.parametrize("fmt,a_shape,n,out", CASES)
def test_matches_numpy_bit_for_bit(fmt, a_shape, n, out):
    rows = (-4, 0) if out == "float16" else (-6, 7)  # float16: results stay finite
    a = operand(1, a_shape, fmt, rows)
    b = operand(2, (*a_shape[:-2], n, a_shape[-1]), fmt, rows)
    got = ffi.fp4_matmul(a, b, out)
    assert got.dtype == out and got.shape == (*a_shape[:-1], n)
    assert_bits_equal(got, reference(a, b, out))


def test_the_reference_is_the_dequantized_product_where_that_is_exact():
    """A sanity check of the reference itself: power-of-two tensor scales, small K."""
    a = jaxmx.quantize(jnp.full((2, 16), 10.5), "nvfp4")  # g = 2^-8
    b = jaxmx.quantize(jnp.full((3, 16), -5.25), "nvfp4")  # g = 2^-9
    want = np.asarray(jaxmx.dequantize(a)) @ np.asarray(jaxmx.dequantize(b)).T
    np.testing.assert_array_equal(reference(a, b, "float32"), want)
    np.testing.assert_array_equal(ffi.fp4_matmul(a, b, jnp.float32), want)


@pytest.mark.parametrize("fmt,tile", [("nvfp4", (32, 16)), ("mxfp4", (8, 32))])
def test_tiled_operands_with_block_wide_tiles(fmt, tile):
    a = operand(3, (40, 50), fmt, tile=tile)
    b = operand(4, (20, 50), fmt)
    assert a.tile == tile
    assert_bits_equal(ffi.fp4_matmul(a, b, jnp.float32), reference(a, b, "float32"))
    assert_bits_equal(ffi.fp4_matmul(b, a, jnp.float32), reference(b, a, "float32"))


def test_jit_equals_eager():
    a, b = operand(5, (6, 48), "nvfp4"), operand(6, (10, 48), "nvfp4")
    jitted = jax.jit(lambda a, b: ffi.fp4_matmul(a, b, jnp.float32))(a, b)
    np.testing.assert_array_equal(jitted, ffi.fp4_matmul(a, b, jnp.float32))
    assert_bits_equal(jitted, reference(a, b, "float32"))


def test_vmap_with_a_tensor_scale_per_element():
    """vmap over NVFP4 operands quantized per element: alpha = g_a[i] * g_b[i] per element."""
    xa = (
        jax.random.normal(jax.random.key(7), (3, 5, 32))
        * jnp.array([1.0, 30.0, 1e-3])[:, None, None]
    )
    xb = (
        jax.random.normal(jax.random.key(8), (3, 4, 32)) * jnp.array([2.0, 1e3, 0.5])[:, None, None]
    )
    qa = jax.vmap(lambda x: jaxmx.quantize(x, "nvfp4"))(xa)
    qb = jax.vmap(lambda x: jaxmx.quantize(x, "nvfp4"))(xb)
    assert qa.global_scale.shape == (3,)
    qb_0 = at(qb, 0)
    both = jax.vmap(lambda a, b: ffi.fp4_matmul(a, b, jnp.float32))(qa, qb)
    lhs_only = jax.vmap(lambda a: ffi.fp4_matmul(a, qb_0, jnp.float32))(qa)
    for i in range(3):
        assert_bits_equal(both[i], reference(at(qa, i), at(qb, i), "float32"))
        assert_bits_equal(lhs_only[i], reference(at(qa, i), qb_0, "float32"))


def test_vmap_of_mxfp4_lhs_folds_into_one_gemm():
    qa = jax.vmap(lambda x: jaxmx.quantize(x, "mxfp4"))(
        jax.random.normal(jax.random.key(9), (4, 3, 64))
    )
    qb = operand(10, (6, 64), "mxfp4")
    got = jax.vmap(lambda a: ffi.fp4_matmul(a, qb, jnp.bfloat16))(qa)
    hlo = jax.jit(jax.vmap(lambda a: ffi.fp4_matmul(a, qb, jnp.bfloat16))).lower(qa).as_text()
    assert "tensor<12x32xui8>" in hlo  # the 4 x 3 rows of a, K / 2 bytes: one folded call
    for i in range(4):
        assert_bits_equal(got[i], reference(at(qa, i), qb, "bfloat16"))


@pytest.mark.parametrize("fmt,nan_byte", [("nvfp4", 0x7F), ("mxfp4", 0xFF)])
def test_a_nan_block_scale_gives_nan_where_its_block_reaches(fmt, nan_byte):
    a, b = operand(11, (4, 64), fmt), operand(12, (5, 64), fmt)
    scale = np.asarray(a.scale).copy()
    scale.view(np.uint8)[2, 1] = nan_byte
    a = dataclasses.replace(a, scale=jnp.asarray(scale))
    got = np.asarray(ffi.fp4_matmul(a, b, jnp.float32))
    assert np.isnan(got[2]).all() and not np.isnan(got[[0, 1, 3]]).any()
    assert_bits_equal(got, reference(a, b, "float32"))


def test_padding_codes_are_ignored():
    a, b = operand(13, (3, 40), "nvfp4"), operand(14, (4, 40), "nvfp4")
    data = np.asarray(a.data).copy()
    data[:, 40:] = 6.0  # a hand-built operand with nonzero padding codes
    dirty = jaxmx.MXArray(
        jnp.asarray(data), a.scale, a.fmt, a.axis, a.shape, a.tile, a.global_scale
    )
    np.testing.assert_array_equal(ffi.fp4_matmul(dirty, b), ffi.fp4_matmul(a, b))


def test_matmul_with_backend_ffi_takes_k_first_operands_to_the_fp4_gemm():
    a = operand(15, (6, 64), "mxfp4")
    b_t = operand(16, (64, 5), "mxfp4", axis=0)  # [K, N] quantized along K
    b = operand(16, (64, 5), "mxfp4", axis=0)
    got = jaxmx.matmul(a, b_t, jnp.float32, backend="ffi")
    tn = jaxmx.MXArray(b.data.T, b.scale.T, "mxfp4", 1, (5, 64))
    np.testing.assert_array_equal(got, ffi.fp4_matmul(a, tn, jnp.float32))


# --- errors -------------------------------------------------------------------------------------


def test_mixed_fp4_formats_are_refused():
    a, b = operand(17, (4, 64), "nvfp4"), operand(18, (4, 64), "mxfp4")
    with pytest.raises(NotImplementedError, match=r"a is nvfp4 and b is mxfp4.*two MXFP4 or two"):
        ffi.fp4_matmul(a, b)


def test_other_formats_are_refused():
    a, b = operand(19, (4, 64), "nvfp4"), operand(20, (4, 64), "mxfp8_e4m3")
    with pytest.raises(NotImplementedError, match=r"b is mxfp8_e4m3.*supported: mxfp4, nvfp4"):
        ffi.fp4_matmul(a, b)


def test_k_first_operands_are_refused():
    a = operand(21, (64, 4), "nvfp4", axis=0)
    with pytest.raises(ValueError, match="TN form"):
        ffi.fp4_matmul(a, operand(22, (4, 64), "nvfp4"))


def test_tiles_narrower_or_wider_than_the_block_are_refused():
    a = operand(23, (32, 64), "nvfp4", tile=(16, 32))
    with pytest.raises(ValueError, match="tiles must be 16 wide"):
        ffi.fp4_matmul(a, operand(24, (4, 64), "nvfp4"))


def raw_fp4_call(out_shape, out_dtype, *args, nvfp4=True):
    """jaxmx_fp4_matmul as a raw custom call (no Python checks)."""
    ffi.register_targets()
    out, _ = jax.ffi.ffi_call(
        ffi.FP4_TARGET,
        (jax.ShapeDtypeStruct(out_shape, out_dtype), jax.ShapeDtypeStruct((0,), jnp.uint8)),
    )(*args, nvfp4=nvfp4)
    return np.asarray(out)


def test_cpp_side_errors():
    codes = jnp.zeros((4, 32), jnp.uint8)  # K = 64
    s_ok = jnp.zeros((512,), jnp.uint8)  # NVFP4: roundup(4, 128) * roundup(64 / 16, 4)
    ab = jnp.zeros((2,), jnp.float32)
    assert raw_fp4_call((4, 4), jnp.float32, codes, codes, s_ok, s_ok, ab).shape == (4, 4)
    cases = [
        ((codes.astype(jnp.int8), codes, s_ok, s_ok, ab), "lhs and rhs must be uint8"),
        ((codes[:, :4], codes[:, :4], s_ok, s_ok, ab), "K must be a multiple of 16 for NVFP4"),
        ((codes, codes, s_ok[:256], s_ok, ab), r"lhs scales must be the swizzled \[..., 512\]"),
        ((codes, codes, s_ok, s_ok.astype(jnp.int8), ab), "rhs scales must be uint8 or float8"),
        ((codes, codes, s_ok, s_ok, ab[:1]), r"alpha_beta must be float32 \[..., 2\]"),
        ((codes, codes, s_ok, s_ok, ab.astype(jnp.float16)), "alpha_beta must be float32"),
    ]
    for args, msg in cases:
        with pytest.raises(Exception, match=f"jaxmx_fp4_matmul: {msg}"):
            raw_fp4_call((4, 4), jnp.float32, *args)
    with pytest.raises(Exception, match="K must be a multiple of 32 for MXFP4"):
        raw_fp4_call((4, 4), jnp.float32, codes[:, :8], codes[:, :8], s_ok, s_ok, ab, nvfp4=False)


# --- backends -----------------------------------------------------------------------------------


def test_fp4_pairs_are_a_native_family_of_one_format():
    assert native_family(("nvfp4", "nvfp4")) == "fp4"
    assert native_family(("mxfp4", "mxfp4")) == "fp4"
    assert native_family(("mxfp4", "nvfp4")) is None
    assert native_family(("nvfp4", "mxfp8_e4m3")) is None
    nvfp4 = Gemm(formats=("nvfp4", "nvfp4"))
    assert kernels(nvfp4, BLACKWELL) == {"default": EMULATE, "cuda": FP4_KERNEL}
    assert kernels(Gemm(formats=("nvfp4", "mxfp4")), BLACKWELL) == {"default": DEQUANTIZED}
    assert kernels(nvfp4, HOPPER) == {"default": EMULATE}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_cpu_handler_equals_the_emulation(fmt):
    """Handler and emulation compute the same sum in different orders (blocks first, or one
    float32 dot): on operands whose partial sums are all exact in float32 they agree bit for
    bit, through matmul and through a dot_general training step with the 4-bit recipe."""
    rng = np.random.default_rng(21)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)

    def on_grid(shape):  # every block's maximum 6: scales fixed, codes = values (x 2^k)
        x = rng.choice(grid, shape) * rng.choice([-1, 1], shape)
        x[..., ::16] = 6.0
        return (x * 2.0 ** rng.integers(-3, 4, (*shape[:-1], 1))).astype(np.float32)

    a, b = on_grid((2, 24, 96)), on_grid((2, 40, 96))
    qa, qb = jaxmx.quantize(a, fmt), jaxmx.quantize(b, fmt)
    native = jaxmx.matmul(qa, qb, jnp.float32, backend="ffi")
    emulated = jaxmx.matmul(qa, qb, jnp.float32, backend="emulate")
    assert_bits_equal(native, emulated)
    recipe = getattr(jaxmx.recipes, fmt.upper()).replace(grad_rounding="nearest", rht=False)
    dims = (((2,), (2,)), ((0,), (0,)))
    g = on_grid((2, 24, 40))

    def step(backend):
        f = lambda x, w: jaxmx.dot_general(x, w, dims, recipe=recipe.replace(backend=backend))
        y, vjp = jax.vjp(f, a, b)
        return (y, *vjp(g))

    for got, want in zip(step("ffi"), step("emulate"), strict=True):
        assert_bits_equal(got, want)
