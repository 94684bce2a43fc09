"""An independent numpy + ml_dtypes reference for MX quantization, written from the spec.

Sources (see docs/quantization.md): the OCP MX v1.0 spec, the cuBLAS /
TransformerEngine rceil formula, torchao's ceil/even modes, the cuBLAS 128x4 scale layout. It
shares no code with jaxmx and deliberately uses different arithmetic:

- scale exponents: float64 ``frexp`` (exact for every float32, subnormals included) for floor and
  ceil, the literal float32 TransformerEngine formula for rceil (numpy keeps float32 subnormals),
  and torchao's integer add-and-mask on the float32 bits for even;
- elements: exact float64 scaling by ``2.0**-e``, saturation, then round-to-nearest-even on the
  element grid with ``np.rint`` in float64 (the result is exactly representable, so the final
  ``astype`` is exact; ml_dtypes' own float64 -> fp8 cast rounds twice, through float32);
- swizzle: the cuBLAS offset formula evaluated per index, no reshapes or transposes.

Example:
    >>> import numpy as np
    >>> data, scale = quantize(np.full((32,), 480.0, np.float32), "mxfp8_e4m3", "rceil")
    >>> int(scale[0]), float(data[0])
    (128, 240.0)
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

BLOCK = 32
E8M0_NAN = 0xFF


@dataclasses.dataclass(frozen=True)
class Spec:
    dtype: type
    elem_max: float
    emax: int  # exponent of the largest power of two in the element format
    emin: int  # exponent of the smallest normal element
    mbits: int  # explicit mantissa bits


SPECS = {
    "mxfp8_e4m3": Spec(ml_dtypes.float8_e4m3fn, 448.0, emax=8, emin=-6, mbits=3),
    "mxfp8_e5m2": Spec(ml_dtypes.float8_e5m2, 57344.0, emax=15, emin=-14, mbits=2),
    "mxfp4": Spec(ml_dtypes.float4_e2m1fn, 6.0, emax=2, emin=0, mbits=1),
}
MODES = ("rceil", "floor", "ceil", "even")


# --- scale exponent ---------------------------------------------------------------------------


def _floor_log2(a: float) -> int:
    """floor(log2(a)) for a finite a > 0, exact (frexp: a = f * 2^k, 0.5 <= f < 1)."""
    _, k = math.frexp(a)
    return k - 1


def _ceil_log2(a: float) -> int:
    f, k = math.frexp(a)
    return k - 1 if f == 0.5 else k


def scale_byte(amax: np.float32, fmt: str, mode: str) -> int:
    """The E8M0 byte of one block whose float32 absolute maximum is ``amax``."""
    spec = SPECS[fmt]
    amax = np.float32(amax)
    if not np.isfinite(amax):
        return E8M0_NAN
    a = float(amax)
    if mode == "rceil":
        # TransformerEngine / cuBLAS, literally: d = amax * fl32(1 / elem_max) in float32.
        d = np.float32(amax * (np.float32(1.0) / np.float32(spec.elem_max)))
        bits = int(np.array(d, np.float32).view(np.uint32))
        biased, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        if mant > 0 and biased != 0xFE and not (biased == 0 and mant <= 0x400000):
            biased += 1
        return biased  # already biased; d is finite and < 2^127, so no clamping is needed
    if a == 0.0:
        e = -127
    elif mode == "floor":
        e = _floor_log2(a) - spec.emax
    elif mode == "ceil":
        e = _ceil_log2(a) - spec.emax
    elif mode == "even":
        # torchao: add half an element ulp to the float32 bits, mask the mantissa off, floor.
        bits = int(np.array(amax, np.float32).view(np.uint32))
        rounded = (bits + (1 << (23 - spec.mbits - 1))) & 0xFF800000
        # a biased exponent of 0xFF here stands for 2^128 (jaxmx keeps such blocks finite where
        # torchao would produce a NaN scale)
        e = (rounded >> 23) - 127 - spec.emax
    else:
        raise ValueError(mode)
    return int(np.clip(e, -127, 127)) + 127


# --- elements -----------------------------------------------------------------------------------


def round_to_grid(v: np.ndarray, fmt: str) -> np.ndarray:
    """Saturating round-to-nearest-even of float64 values onto the element grid (float64 out)."""
    spec = SPECS[fmt]
    v = np.clip(np.asarray(v, np.float64), -spec.elem_max, spec.elem_max)
    out = np.zeros_like(v)
    nz = v != 0
    _, k = np.frexp(np.abs(v[nz]))  # |v| = f * 2^k, 0.5 <= f < 1: floor(log2|v|) = k - 1
    quantum = np.ldexp(1.0, np.maximum(k - 1, spec.emin) - spec.mbits)
    out[nz] = np.rint(v[nz] / quantum) * quantum  # exact division by a power of two; rint = RNE
    return np.copysign(out, v)  # keep the sign of zeros (e.g. -tiny -> -0)


def quantize(x: np.ndarray, fmt: str, mode: str = "rceil", axis: int = -1):
    """Reference MX quantization along ``axis``.

    Args:
        x: float32, float16 or bfloat16 numpy array of rank >= 1.

    Returns:
        ``(data, scale)``: ``data`` in the element dtype, zero-padded along ``axis`` to a multiple
        of 32; ``scale`` uint8 E8M0 bytes with ``axis`` divided by 32. Elements of NaN-scale blocks
        are set to 0 (their value is undefined; they dequantize to NaN).
    """
    spec = SPECS[fmt]
    x = np.asarray(x)
    axis = axis % x.ndim
    x32 = x.astype(np.float32)  # exact for float16 / bfloat16 (numpy keeps subnormals)
    xm = np.moveaxis(x32, axis, -1)
    n = xm.shape[-1]
    padded = -(-n // BLOCK) * BLOCK
    xm = np.concatenate([xm, np.zeros((*xm.shape[:-1], padded - n), np.float32)], axis=-1)
    blocks = xm.reshape(-1, padded // BLOCK, BLOCK)
    amax = np.max(np.abs(blocks), axis=-1)  # float32; NaN propagates
    scale = np.array([scale_byte(a, fmt, mode) for a in amax.ravel()], np.uint8)
    scale = scale.reshape(amax.shape)
    finite = scale != E8M0_NAN
    factor = np.ldexp(1.0, 127 - scale.astype(np.int64))[..., None]  # 2^-e, exact in float64
    values = round_to_grid(np.where(finite[..., None], blocks * factor, 0.0), fmt)
    data = values.astype(spec.dtype)
    if not np.array_equal(data.astype(np.float64), values):
        raise AssertionError("reference rounding produced an unrepresentable value")
    data = np.moveaxis(data.reshape(*xm.shape), -1, axis)
    scale = np.moveaxis(scale.reshape(*xm.shape[:-1], padded // BLOCK), -1, axis)
    return data, scale


def dequantize(data: np.ndarray, scale: np.ndarray, axis: int, shape) -> np.ndarray:
    """Reference dequantization in float64; NaN-scale blocks become NaN. Returns ``shape``."""
    axis = axis % data.ndim
    s = np.repeat(np.asarray(scale).astype(np.int64), BLOCK, axis=axis)
    out = np.asarray(data).astype(np.float64) * np.ldexp(1.0, s - 127)
    out = np.where(s == E8M0_NAN, np.nan, out)
    index = tuple(slice(0, n) for n in shape)
    return out[index]


# --- the cuBLAS 128x4 scale layout -------------------------------------------------------------


def _roundup(n: int, m: int) -> int:
    return -(-n // m) * m


def swizzle_offset(r, c, cols: int):
    """The cuBLAS 128x4 layout: the byte offset of scale S[r, c] in the swizzled buffer."""
    cp = _roundup(cols, 4)
    return ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def swizzle(s: np.ndarray) -> np.ndarray:
    """[..., R, C] uint8 -> [..., Rp * Cp] uint8, zero padding, by explicit index arithmetic."""
    s = np.asarray(s)
    *batch, rows, cols = s.shape
    out = np.zeros((*batch, _roundup(rows, 128) * _roundup(cols, 4)), np.uint8)
    r, c = np.indices((rows, cols))
    out[..., swizzle_offset(r, c, cols)] = s
    return out


def unswizzle(buf: np.ndarray, rows: int, cols: int) -> np.ndarray:
    r, c = np.indices((rows, cols))
    return np.asarray(buf)[..., swizzle_offset(r, c, cols)]


# --- NVFP4 ------------------------------------------------------------------------------------

F32 = np.float32
FLOAT32_MAX = F32(np.finfo(np.float32).max)


def nvfp4(x, axis=-1, tile=None, global_scale=None):
    """NVFP4 ``(codes [padded shape], E4M3 scales, g, decoded values [padded shape])``: the
    formulas of docs/quantization.md in numpy float32 (subnormals kept), casts by ml_dtypes."""
    x = np.asarray(x).astype(np.float32)
    with np.errstate(all="ignore"):
        if global_scale is None:
            amax = np.max(np.abs(x))
            g = max(F32(amax) / F32(448 * 6), F32(2.0**-126))
            g = F32(np.nan) if not np.isfinite(amax) else g
        else:
            g = max(F32(global_scale), F32(2.0**-126))
        if tile is None:
            moved = np.moveaxis(x, axis, -1)
            pad = -moved.shape[-1] % 16
            moved = np.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, pad)])
            blocks = moved.reshape(*moved.shape[:-1], -1, 16)
        else:
            r, c = tile
            pads = [(0, 0)] * (x.ndim - 2) + [(0, -x.shape[-2] % r), (0, -x.shape[-1] % c)]
            padded = np.pad(x, pads)
            R, C = padded.shape[-2:]
            t = padded.reshape(*padded.shape[:-2], R // r, r, C // c, c)
            blocks = np.moveaxis(t, -3, -2).reshape(*padded.shape[:-2], R // r, C // c, r * c)
        block_amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
        b = (block_amax / F32(6)) / g
        s = np.clip(b, F32(2.0**-6), F32(448)).astype(ml_dtypes.float8_e4m3fn)
        bad = ~np.isfinite(block_amax) | np.isnan(g)
        s = np.where(bad, np.float32(np.nan), s.astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
        sf = s.astype(np.float32)
        r_ = np.minimum((F32(1) / g) / sf, FLOAT32_MAX)
        codes = np.clip(blocks * r_, F32(-6), F32(6)).astype(ml_dtypes.float4_e2m1fn)
        codes = np.where(np.isnan(sf), F32(0), codes.astype(np.float32))
        values = (codes * sf) * g
    scales = s[..., 0] if tile else np.moveaxis(s[..., 0], -1, axis)

    def back(a):  # blocked layout -> padded data layout
        if tile is None:
            a = a.reshape(*a.shape[:-2], -1)
            return np.moveaxis(a, -1, axis)
        r, c = tile
        lead, (nr, nc) = a.shape[:-3], a.shape[-3:-1]
        a = a.reshape(*lead, nr, nc, r, c)
        return np.moveaxis(a, -2, -3).reshape(*lead, nr * r, nc * c)

    return back(codes).astype(ml_dtypes.float4_e2m1fn), scales, g, back(values)
