"""MXFP6 (E2M3, E3M2) and MXINT8 against an independent numpy + ml_dtypes reference.

The reference below shares no code with jaxmx: block exponents from exact float64 ``frexp``
per scale mode, elements scaled exactly in float64, saturated, then cast by ml_dtypes' float6
types (FP6) or rounded half to even by ``np.rint`` on the 2^-6 grid (MXINT8).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxmx

BLOCK = 32
NAN_BYTE = 0xFF


@dataclasses.dataclass(frozen=True)
class Spec:
    dtype: object  # ml_dtypes float6 type, or None for int8 codes
    elem_max: float
    emax: int
    mbits: int  # mantissa bits (MXINT8: the 6 fraction bits of code * 2^-6)


SPECS = {
    "mxfp6_e2m3": Spec(ml_dtypes.float6_e2m3fn, 7.5, emax=2, mbits=3),
    "mxfp6_e3m2": Spec(ml_dtypes.float6_e3m2fn, 28.0, emax=4, mbits=2),
    "mxint8": Spec(None, 127 / 64, emax=0, mbits=6),
}
FORMATS = tuple(SPECS)
MODES = ("rceil", "floor", "ceil", "even")


def ref_block_exponent(amax: float, spec: Spec, mode: str) -> int:
    """The E8M0 exponent k of a block (scale 2^k) with finite float32 absolute maximum
    ``amax``, clamped to [-127, 127], from the definitions of the modes."""
    if amax == 0.0:
        return -127
    f, e = math.frexp(amax)  # amax = f * 2^e, 0.5 <= f < 1, exact
    floor_log2 = e - 1
    if mode == "floor":
        k = floor_log2 - spec.emax
    elif mode == "ceil":
        k = (floor_log2 if f == 0.5 else e) - spec.emax
    elif mode == "even":  # amax rounded to mbits mantissa bits, ties away from zero
        significand = math.floor(2 * f * 2**spec.mbits + 0.5) / 2**spec.mbits
        k = floor_log2 + (significand >= 2) - spec.emax
    else:  # rceil: the smallest k with amax <= elem_max * 2^k
        k = floor_log2 - spec.emax
        if amax > spec.elem_max * 2.0**k:
            k += 1
        # cuBLAS's one exception (docs/quantization.md): amax with biased exponent emax and
        # mantissa one above elem_max's is not rounded up
        bits = int(np.float32(amax).view(np.uint32))
        edge_mantissa = (int(np.float32(spec.elem_max).view(np.uint32)) & 0x7FFFFF) + 1
        if spec.emax >= 1 and bits >> 23 == spec.emax and bits & 0x7FFFFF == edge_mantissa:
            k -= 1
    return int(np.clip(k, -127, 127))


def ref_codes(values: np.ndarray, spec: Spec) -> np.ndarray:
    """Codes (uint8 FP6 bits / int8) of exactly scaled float64 values, saturating, RNE."""
    v = np.clip(values, -spec.elem_max, spec.elem_max)
    if spec.dtype is None:
        return np.rint(v * 64).astype(np.int8)  # np.rint: round half to even
    # |v| >= 2^-126 is exact in float32; smaller values round to zero in FP6 either way
    return v.astype(np.float32).astype(spec.dtype).view(np.uint8)


def ref_quantize(x, fmt: str, mode: str, axis: int):
    """(codes, scale bytes) padded along ``axis`` as jaxmx lays them out."""
    spec = SPECS[fmt]
    x = np.moveaxis(np.asarray(x).astype(np.float32), axis, -1)
    n = x.shape[-1]
    pad = -n % BLOCK
    x = np.concatenate([x, np.zeros((*x.shape[:-1], pad), np.float32)], -1)
    blocks = x.reshape(-1, BLOCK).astype(np.float64)
    codes = np.zeros(blocks.shape, np.int8 if spec.dtype is None else np.uint8)
    scale = np.zeros(blocks.shape[0], np.uint8)
    for i, block in enumerate(blocks):
        if not np.isfinite(block).all():
            scale[i] = NAN_BYTE
            finite = np.where(np.isfinite(block), block, 0.0)
            zero = ref_codes(np.copysign(0.0, finite), spec)  # finite elements: signed zeros
            codes[i] = zero
            continue
        k = ref_block_exponent(float(np.max(np.abs(block))), spec, mode)
        scale[i] = k + 127
        codes[i] = ref_codes(block * 2.0**-k, spec)
    codes = np.moveaxis(codes.reshape(x.shape), -1, axis)
    scale = np.moveaxis(scale.reshape(*x.shape[:-1], -1), -1, axis)
    return codes, scale


def ref_dequantize(codes, scale, fmt: str, axis: int, n: int) -> np.ndarray:
    spec = SPECS[fmt]
    if spec.dtype is None:
        values = codes.astype(np.float64) / 64
    else:
        values = codes.view(spec.dtype).astype(np.float64)
    s = np.repeat(scale.astype(np.int64), BLOCK, axis=axis)
    out = np.where(s == NAN_BYTE, np.nan, values * np.ldexp(1.0, s - 127))
    return np.take(out, np.arange(n), axis=axis).astype(np.float32)


def adversarial(rng) -> np.ndarray:
    """[13, 80] float32 rows: zeros, subnormals, NaN, inf, near float32 max, huge spans, grid
    ties and saturating values (80 = two blocks and a padded third)."""
    rows = [rng.standard_normal(80)]
    rows.append(np.zeros(80))
    rows.append(rng.integers(1, 1 << 23, 80) * 2.0**-149 * rng.choice([-1, 1], 80))  # subnormal
    nan = rng.standard_normal(80)
    nan[[3, 40]] = np.nan
    rows.append(nan)
    inf = rng.standard_normal(80)
    inf[[5, 70]] = [np.inf, -np.inf]
    rows.append(inf)
    big = np.float32(np.finfo(np.float32).max) * rng.uniform(0.5, 1.0, 80)
    big[[0, 33, 66]] = np.finfo(np.float32).max
    rows.append(big * rng.choice([-1, 1], 80))
    span = 2.0 ** rng.integers(-140, 128, 80).astype(np.float64) * rng.uniform(1, 2, 80)
    rows.append(np.minimum(span, np.finfo(np.float32).max) * rng.choice([-1, 1], 80))
    span = rng.standard_normal(80) * 2.0**-100
    span[[1, 34, 65]] = 2.0**100
    rows.append(span)
    # grid midpoints and elem_max multiples at several scales: ties and the rceil threshold
    grid = np.concatenate([np.arange(0.5, 40, 0.5) / 64, [1.9921875, 7.75, 30.0]])[:80]
    rows.append(grid * 2.0 ** rng.integers(-3, 4, 80) * rng.choice([-1, 1], 80))
    rows.append(
        np.tile([7.5, 28.0, 127 / 64, 7.5000005, 28.000002, 1.9843751, -0.0, 2.0**-126], 10)
    )
    tiny = rng.standard_normal(80) * 2.0**-120  # amax just above the smallest normal float32
    tiny[[2, 50]] = [1.99 * 2.0**-126, 0.995 * 2.0**-126]
    rows.append(tiny)
    rows.append(-np.abs(rng.standard_normal(80)) * 1e-3)
    # subnormal block maxima where emax = 0 (MXINT8) tells them from 2^-126: rceil's threshold
    # elem_max * 2^-127 = 0x7F0000 * 2^-149, ceil's 2^-127 and 2^-128
    sub = rng.integers(1, 1 << 20, 80) * 2.0**-149
    sub[[0, 32, 64]] = np.array([0x7E8000, 1 << 21, 0x600000]) * 2.0**-149
    rows.append(sub * rng.choice([-1, 1], 80))
    return np.array(rows, np.float64).astype(np.float32)


@pytest.fixture(scope="module")
def x():
    return adversarial(np.random.default_rng(0))


def assert_codes(q, fmt, mode, x, axis):
    codes, scale = ref_quantize(x, fmt, mode, axis)
    np.testing.assert_array_equal(np.asarray(q.scale).view(np.uint8), scale)
    got = np.asarray(q.data)
    assert got.dtype == codes.dtype, (got.dtype, codes.dtype)
    nan_block = np.repeat(scale == NAN_BYTE, BLOCK, axis=axis)
    nonfinite = np.pad(
        ~np.isfinite(x), [(0, c - s) for s, c in zip(x.shape, codes.shape, strict=True)]
    )
    # a NaN or inf element of a NaN-scale block: its code (any sign) is the format's own choice
    mask = nan_block & nonfinite
    np.testing.assert_array_equal(np.where(mask, 0, got), np.where(mask, 0, codes))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", MODES)
def test_codes_and_scales_equal_the_reference(x, fmt, mode):
    for axis in (1, 0):
        assert_codes(jaxmx.quantize(x, fmt, axis, mode), fmt, mode, x, axis)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rank3_middle_axis_and_input_dtypes(fmt):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 40, 3)) * 2.0 ** rng.integers(-8, 8, (2, 40, 3))).astype(
        np.float32
    )
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        xd = np.asarray(jnp.asarray(x, dtype))
        q = jaxmx.quantize(xd, fmt, axis=1)
        assert_codes(q, fmt, "rceil", xd.astype(np.float32), 1)
        want = ref_dequantize(*ref_quantize(xd, fmt, "rceil", 1), fmt, 1, 40)
        np.testing.assert_array_equal(np.asarray(jaxmx.dequantize(q)), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_and_fake_quantize(x, fmt):
    for axis in (1, 0):
        q = jaxmx.quantize(x, fmt, axis, "floor")
        codes, scale = ref_quantize(x, fmt, "floor", axis)
        want = ref_dequantize(codes, scale, fmt, axis, x.shape[axis])
        got = np.asarray(jaxmx.dequantize(q))
        np.testing.assert_array_equal(got, want)
        fake = np.asarray(jaxmx.fake_quantize(x, fmt, axis, "floor"))
        nan = np.isnan(got)
        np.testing.assert_array_equal(np.isnan(fake), nan)
        # bit for bit, signed zeros included
        np.testing.assert_array_equal(fake.view(np.uint32)[~nan], got.view(np.uint32)[~nan])


def test_format_facts():
    e2m3, e3m2, int8 = (jaxmx.FORMATS[f] for f in FORMATS)
    assert (e2m3.bits, e2m3.storage_bits, e2m3.dtype) == (6, 8, jnp.uint8)
    assert (e3m2.elem_max, e3m2.has_inf, e3m2.is_fp8, e3m2.is_integer) == (
        28.0,
        False,
        False,
        False,
    )
    assert (int8.bits, int8.elem_max, int8.is_integer, int8.dtype) == (8, 1.984375, True, jnp.int8)
    q = jaxmx.quantize(jnp.ones((2, 64)), "mxfp6_e2m3")
    assert q.nbytes == 2 * 64 * 3 // 4 + 2 * 2  # four FP6 codes per three bytes, a byte per scale
    assert "mxint8" in jaxmx.FORMATS and "mxfp6_e3m2" in jaxmx.FORMATS


def assert_same(a, b):
    """Two MXArrays with the same codes and scale bytes."""
    np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    np.testing.assert_array_equal(
        np.asarray(a.scale).view(np.uint8), np.asarray(b.scale).view(np.uint8)
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_pallas_equals_xla(fmt):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((40, 72)) * 2.0 ** rng.integers(-20, 20, (40, 72))).astype(np.float32)
    x[3, 5] = np.nan
    for mode, axis in (("rceil", 1), ("even", 0)):
        a = jaxmx.quantize(x, fmt, axis, mode, impl="pallas")
        b = jaxmx.quantize(x, fmt, axis, mode, impl="xla")
        assert_same(a, b)
    key = jax.random.key(4)
    for kw in (dict(tile=(32, 32)), dict(key=key)):
        a, b = (jaxmx.quantize(x, fmt, impl=impl, **kw) for impl in ("pallas", "xla"))
        assert_same(a, b)
    copies = [jaxmx.quantize_rowwise_colwise(x, fmt, impl=i) for i in ("pallas", "xla")]
    for a, b in zip(*copies, strict=True):
        assert_same(a, b)
    row, col_t = copies[1]
    assert_codes(row, fmt, "rceil", x, 1)
    assert_codes(col_t, fmt, "rceil", x.T, 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiles_hold_the_reference_codes_of_each_tile(fmt):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 64)).astype(np.float32) * 2.0 ** rng.integers(-9, 9, (64, 1))
    q = jaxmx.quantize(x, fmt, tile=(32, 32))
    for i in range(2):
        for j in range(2):
            tile = x[32 * i : 32 * i + 32, 32 * j : 32 * j + 32].reshape(1, 1024)
            k = ref_block_exponent(float(np.abs(tile).max()), SPECS[fmt], "rceil")
            assert int(np.asarray(q.scale).view(np.uint8)[i, j]) == k + 127
            want = ref_codes(tile.astype(np.float64) * 2.0**-k, SPECS[fmt]).reshape(32, 32)
            got = np.asarray(q.data)[32 * i : 32 * i + 32, 32 * j : 32 * j + 32]
            np.testing.assert_array_equal(got, want)


def grid_of(fmt: str) -> np.ndarray:
    """Every finite element value of ``fmt``, sorted."""
    spec = SPECS[fmt]
    if spec.dtype is None:
        return np.arange(-127, 128) / 64
    return np.unique(np.arange(64, dtype=np.uint8).view(spec.dtype).astype(np.float64))


@pytest.mark.parametrize("fmt", FORMATS)
def test_stochastic_rounding_picks_a_neighbour_without_bias(fmt):
    x = np.full((64, 32), 0.0, np.float32)
    x[:, 0] = SPECS[fmt].elem_max  # the scale is 2^0 in every row (rceil)
    x[:, 1:] = np.linspace(-1.3, 1.7, 31, dtype=np.float32)
    key = jax.random.key(7)
    values = np.asarray(jaxmx.dequantize(jaxmx.quantize(x, fmt, key=key)), np.float64)
    grid = grid_of(fmt)
    v = x.astype(np.float64)
    below = grid[np.searchsorted(grid, v, side="right") - 1]
    above = grid[np.minimum(np.searchsorted(grid, v, side="left"), grid.size - 1)]
    assert ((values == below) | (values == above)).all()
    assert np.abs(values.mean(0)[1:] - v[0, 1:]).max() < 0.5 * np.diff(grid).max()
    fake = np.asarray(jaxmx.fake_quantize(x, fmt, key=key), np.float64)
    np.testing.assert_array_equal(fake, values)


DIMS = (((1,), (1,)), ((), ()))


def dequantized64(x, fmt, axis):
    return np.asarray(jaxmx.dequantize(jaxmx.quantize(x, fmt, axis)), np.float64)


@pytest.mark.parametrize(
    "fwd,grad", [(f, f) for f in FORMATS] + [("mxfp6_e2m3", "mxfp8_e5m2"), ("mxint8", "mxfp8_e4m3")]
)
def test_emulated_dot_general_and_gradients(fwd, grad):
    """y = x w^T and its gradients equal a float64 GEMM of the quantized operands (small
    integers times powers of two: the float32 sums are exact here)."""
    rng = np.random.default_rng(5)
    x = (rng.integers(-8, 9, (8, 64)) / 4).astype(np.float32)
    w = (rng.integers(-8, 9, (16, 64)) / 8).astype(np.float32)
    g = (rng.integers(-8, 9, (8, 16)) / 2).astype(np.float32)
    recipe = jaxmx.Recipe(fwd=fwd, grad=grad)
    y, vjp = jax.vjp(lambda x, w: jaxmx.dot_general(x, w, DIMS, recipe=recipe), x, w)
    dx, dw = vjp(g)
    np.testing.assert_array_equal(
        np.asarray(y), dequantized64(x, fwd, 1) @ dequantized64(w, fwd, 1).T
    )
    want_dx = dequantized64(g, grad, 1) @ dequantized64(w, fwd, 0)
    np.testing.assert_array_equal(np.asarray(dx), want_dx)
    want_dw = dequantized64(g, grad, 0).T @ dequantized64(x, fwd, 0)
    np.testing.assert_array_equal(np.asarray(dw), want_dw)
    a, b = jaxmx.quantize(x, fwd), jaxmx.quantize(w, fwd)
    got = jaxmx.matmul(a, b, jnp.float32, backend="emulate")
    np.testing.assert_array_equal(
        np.asarray(got), dequantized64(x, fwd, 1) @ dequantized64(w, fwd, 1).T
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_backends_refuse_by_name(fmt):
    a = jaxmx.quantize(jnp.ones((4, 32)), fmt)
    with pytest.raises(NotImplementedError, match=f"{fmt} has no native GEMM"):
        jaxmx.matmul(a, a, backend="ffi")
    with pytest.raises(ValueError, match=f"{fmt} has elements with no XLA element type"):
        jaxmx.matmul(a, a, backend="xla")
    with pytest.raises(ValueError, match="no XLA element type"):
        jaxmx.Recipe(fwd=fmt, grad="mxfp8_e5m2", backend="xla")


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_stats(fmt):
    x = np.zeros((1, 64), np.float32)
    x[0, :32] = np.linspace(0.1, 3.0, 32)
    x[0, 32:] = 2.0**-100  # a subnormal-scaled-free block: every element equal
    stats = jaxmx.diagnostics.block_stats(x, fmt)
    k = ref_block_exponent(3.0, SPECS[fmt], "rceil")
    assert np.asarray(stats.scale_exp).tolist() == [
        [k, ref_block_exponent(2.0**-100, SPECS[fmt], "rceil")]
    ]
    codes, scale = ref_quantize(x, fmt, "rceil", 1)
    deq = ref_dequantize(codes, scale, fmt, 1, 64).astype(np.float64)
    err = ((x[0, :32] - deq[0, :32]) ** 2).sum()
    want = 10 * np.log10((x[0, :32].astype(np.float64) ** 2).sum() / err)
    np.testing.assert_allclose(np.asarray(stats.sqnr_db)[0, 0], want, rtol=1e-4)
    assert float(np.asarray(stats.saturated)[0, 0]) == 0.0
