"""An independent numpy + ml_dtypes reference for block-scaled quantization, written from the
specs: MX (E8M0 scales), NVFP4, block FP8 and per-tensor / per-row FP8 scales, and the cuBLAS
scale swizzle. A format's facts (block, element bits, ``emax``, ``emin``, ``mbits``,
``elem_max``) come from a name of :data:`SPECS` or from any object with those fields (a
``jaxmx.FORMATS`` entry: :func:`spec_of`); the block is an argument, 32 by default.

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
"""The OCP MX block, the default of :func:`quantize` and :func:`dequantize`."""
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
_E4M3 = Spec(ml_dtypes.float8_e4m3fn, 448.0, emax=8, emin=-6, mbits=3)
_E5M2 = Spec(ml_dtypes.float8_e5m2, 57344.0, emax=15, emin=-14, mbits=2)
FP8_SPECS = {
    f"fp8_{name}_{kind}": spec
    for name, spec in (("e4m3", _E4M3), ("e5m2", _E5M2))
    for kind in ("block", "tensor", "row")
}
"""The element facts of the FP8 formats with float32 scales (per block, tensor or row)."""
MODES = ("rceil", "floor", "ceil", "even")


def spec_of(fmt) -> Spec:
    """The :class:`Spec` of a name in :data:`SPECS` or :data:`FP8_SPECS`, a ``Spec``, or a
    format table entry (read from its fields: ``element_dtype`` or ``dtype``, ``elem_max``,
    ``emax``, ``emin``, ``mbits``)."""
    if isinstance(fmt, str):
        return SPECS[fmt] if fmt in SPECS else FP8_SPECS[fmt]
    if isinstance(fmt, Spec):
        return fmt
    dtype = fmt.dtype if fmt.element_dtype is None else fmt.element_dtype
    return Spec(dtype, fmt.elem_max, emax=fmt.emax, emin=fmt.emin, mbits=fmt.mbits)


# --- scale exponent ---------------------------------------------------------------------------


def _floor_log2(a: float) -> int:
    """floor(log2(a)) for a finite a > 0, exact (frexp: a = f * 2^k, 0.5 <= f < 1)."""
    _, k = math.frexp(a)
    return k - 1


def _ceil_log2(a: float) -> int:
    f, k = math.frexp(a)
    return k - 1 if f == 0.5 else k


def scale_byte(amax: np.float32, fmt: str, mode: str) -> int:
    """The E8M0 byte of one block whose float32 absolute maximum is ``amax`` (``fmt``: see
    :func:`spec_of`)."""
    spec = spec_of(fmt)
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
    spec = spec_of(fmt)
    v = np.clip(np.asarray(v, np.float64), -spec.elem_max, spec.elem_max)
    out = np.zeros_like(v)
    nz = v != 0
    _, k = np.frexp(np.abs(v[nz]))  # |v| = f * 2^k, 0.5 <= f < 1: floor(log2|v|) = k - 1
    quantum = np.ldexp(1.0, np.maximum(k - 1, spec.emin) - spec.mbits)
    out[nz] = np.rint(v[nz] / quantum) * quantum  # exact division by a power of two; rint = RNE
    return np.copysign(out, v)  # keep the sign of zeros (e.g. -tiny -> -0)


def quantize(x: np.ndarray, fmt, mode: str = "rceil", axis: int = -1, block: int = BLOCK):
    """Reference MX quantization along ``axis`` in blocks of ``block``.

    Args:
        x: float32, float16 or bfloat16 numpy array of rank >= 1.
        fmt: a name of :data:`SPECS` or a format (:func:`spec_of`).

    Returns:
        ``(data, scale)``: ``data`` the float64 element values, zero-padded along ``axis`` to a
        multiple of ``block``, in the element dtype where it is a float type; ``scale`` uint8
        E8M0 bytes with ``axis`` divided by ``block``. Elements of NaN-scale blocks are set to 0
        (their value is undefined; they dequantize to NaN).
    """
    spec = spec_of(fmt)
    x = np.asarray(x)
    axis = axis % x.ndim
    x32 = x.astype(np.float32)  # exact for float16 / bfloat16 (numpy keeps subnormals)
    xm = np.moveaxis(x32, axis, -1)
    n = xm.shape[-1]
    padded = -(-n // block) * block
    xm = np.concatenate([xm, np.zeros((*xm.shape[:-1], padded - n), np.float32)], axis=-1)
    blocks = xm.reshape(-1, padded // block, block)
    amax = np.max(np.abs(blocks), axis=-1)  # float32; NaN propagates
    scale = np.array([scale_byte(a, fmt, mode) for a in amax.ravel()], np.uint8)
    scale = scale.reshape(amax.shape)
    finite = scale != E8M0_NAN
    factor = np.ldexp(1.0, 127 - scale.astype(np.int64))[..., None]  # 2^-e, exact in float64
    values = round_to_grid(np.where(finite[..., None], blocks * factor, 0.0), fmt)
    data = values.astype(spec.dtype) if _is_float(spec.dtype) else values
    if not np.array_equal(data.astype(np.float64), values):
        raise AssertionError("reference rounding produced an unrepresentable value")
    data = np.moveaxis(data.reshape(*xm.shape), -1, axis)
    scale = np.moveaxis(scale.reshape(*xm.shape[:-1], padded // block), -1, axis)
    return data, scale


def _is_float(dtype) -> bool:
    """Whether ``dtype`` is a float type (numpy's or ml_dtypes'), not integer codes."""
    return not np.issubdtype(np.dtype(dtype), np.integer)


def dequantize(data: np.ndarray, scale: np.ndarray, axis: int, shape, block: int = BLOCK):
    """Reference dequantization in float64 of element values ``data`` and E8M0 bytes ``scale``
    in blocks of ``block``; NaN-scale blocks become NaN. Returns ``shape``."""
    axis = axis % data.ndim
    s = np.repeat(np.asarray(scale).astype(np.int64), block, axis=axis)
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


def nvfp4(x, axis=-1, tile=None, global_scale=None, block=16, elem_max=6.0):
    """NVFP4 ``(codes [padded shape], E4M3 scales, g, decoded values [padded shape])`` in blocks
    of ``block`` (or 2-D tiles): the formulas of docs/quantization.md in numpy float32
    (subnormals kept), casts by ml_dtypes; ``elem_max``: E2M1's largest element."""
    x = np.asarray(x).astype(np.float32)
    top = F32(elem_max)
    with np.errstate(all="ignore"):
        if global_scale is None:
            amax = np.max(np.abs(x))
            g = max(F32(amax) / (F32(448) * top), F32(2.0**-126))
            g = F32(np.nan) if not np.isfinite(amax) else g
        else:
            g = max(F32(global_scale), F32(2.0**-126))
        if tile is None:
            moved = np.moveaxis(x, axis, -1)
            pad = -moved.shape[-1] % block
            moved = np.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, pad)])
            blocks = moved.reshape(*moved.shape[:-1], -1, block)
        else:
            r, c = tile
            pads = [(0, 0)] * (x.ndim - 2) + [(0, -x.shape[-2] % r), (0, -x.shape[-1] % c)]
            padded = np.pad(x, pads)
            R, C = padded.shape[-2:]
            t = padded.reshape(*padded.shape[:-2], R // r, r, C // c, c)
            blocks = np.moveaxis(t, -3, -2).reshape(*padded.shape[:-2], R // r, C // c, r * c)
        block_amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
        b = (block_amax / top) / g
        s = np.clip(b, F32(2.0**-6), F32(448)).astype(ml_dtypes.float8_e4m3fn)
        bad = ~np.isfinite(block_amax) | np.isnan(g)
        s = np.where(bad, np.float32(np.nan), s.astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
        sf = s.astype(np.float32)
        r_ = np.minimum((F32(1) / g) / sf, FLOAT32_MAX)
        codes = np.clip(blocks * r_, -top, top).astype(ml_dtypes.float4_e2m1fn)
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


# --- block FP8: float32 scales per block or tile ------------------------------------------------


def block_fp8_scale(v: np.ndarray, elem_max: float, mode: str) -> np.float32:
    """One block's float32 scale, from the definitions (float32 amax, float32 division)."""
    amax = np.max(np.abs(v.astype(np.float32)))
    if not np.isfinite(amax):
        return np.float32(np.nan)
    if amax == 0:
        return np.float32(1.0)
    if mode == "fp32":
        return max(np.float32(amax) / np.float32(elem_max), np.float32(2.0**-126))
    k = math.ceil(math.log2(float(amax) / elem_max))
    while float(amax) > elem_max * 2.0**k:  # exact comparisons fix log2's last bit
        k += 1
    while k > -127 and float(amax) <= elem_max * 2.0 ** (k - 1):
        k -= 1
    return np.float32(2.0 ** max(k, -127))


def block_fp8(x, fmt, mode, axis=-1, tile=None, block=128):
    """(codes, scales) of x quantized per block of ``block`` along axis, or per tile of the last
    two axes, zero-padded; codes are E(x / s) with float32 division and saturation (``fmt``:
    see :func:`spec_of`)."""
    spec = spec_of(fmt)
    x = np.asarray(x).astype(np.float32)
    if tile is None:
        x = np.moveaxis(x, axis, -1)
        rows, cols = 1, block
    else:
        rows, cols = tile
    pad = [(0, 0)] * (x.ndim - 2) + [(0, -x.shape[-2] % rows), (0, -x.shape[-1] % cols)]
    x = np.pad(x, pad)
    r, c = x.shape[-2:]
    scales = np.zeros((*x.shape[:-2], r // rows, c // cols), np.float32)
    codes = np.zeros(x.shape, spec.dtype)
    for idx in np.ndindex(scales.shape):
        lead, i, j = idx[:-2], idx[-2], idx[-1]
        sl = (*lead, slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
        s = block_fp8_scale(x[sl], spec.elem_max, mode)
        scales[idx] = s
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            codes[sl] = np.clip(x[sl] / s, -spec.elem_max, spec.elem_max).astype(spec.dtype)
    if tile is None:
        return np.moveaxis(codes, -1, axis), np.moveaxis(scales, -1, axis)
    return codes, scales


# --- FP8 with one float32 scale per tensor or per row (torchao's current scaling) ---------------


def current_fp8(x, fmt, axis, scale_mode: str = "fp32"):
    """(codes, float32 scales) as torchao computes them: amax per tensor or per row along
    ``axis`` as ``fmt`` says (its ``span``, or a name ending in ``_tensor`` / ``_row``), the
    scale ``elem_max / max(amax, 1e-12)`` in float64 rounded to float32
    (``pow2``: rounded down to a power of two), codes the RNE cast of ``clip(x * scale)``; NaN
    scale for a NaN/inf amax (``fmt``: see :func:`spec_of`)."""
    spec = spec_of(fmt)
    x = np.asarray(np.asarray(x).astype(np.float32))
    a = np.abs(x)
    span = fmt.rsplit("_", 1)[-1] if isinstance(fmt, str) else fmt.span
    amax = a.max(keepdims=True) if span == "tensor" else a.max(axis=axis, keepdims=True)
    with np.errstate(all="ignore"):
        scale = (spec.elem_max / np.maximum(amax.astype(np.float64), 1e-12)).astype(np.float32)
        if scale_mode == "pow2":
            _, e = np.frexp(scale)  # scale = m * 2^e, m in [0.5, 1)
            scale = np.ldexp(np.float32(1.0), e - 1).astype(np.float32)
        scale = np.where(np.isfinite(amax), scale, np.float32(np.nan)).astype(np.float32)
        codes = np.clip(x * scale, -spec.elem_max, spec.elem_max).astype(spec.dtype)
    return codes, scale


def current_fp8_decoded(codes, scale):
    """The float32 values of per-tensor / per-row codes: ``code / scale``."""
    with np.errstate(all="ignore"):
        return codes.astype(np.float32) / scale


# --- any format of the table, by its scale kind -------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quantized:
    """A format's quantization of one array by the reference.

    Attributes:
        codes: the stored element codes (padded along the block axis), in the format's storage
            dtype; ``None`` where no ml_dtypes type holds the elements (E5M6's 12 bits).
        scales: the scales as stored: E8M0 bytes (``uint8``), float32 or E4M3.
        global_scale: the float32 tensor scale above the block scales, else ``None``.
        values: the decoded values, float64, of the logical shape.
    """

    codes: np.ndarray | None
    scales: np.ndarray
    global_scale: np.ndarray | None
    values: np.ndarray


def quantized(f, x, axis: int = -1) -> Quantized:
    """``x`` quantized along ``axis`` in format ``f`` (a format table entry: its scale kind's
    name, its default scale rule, ``block``, ``span``, element facts), with the arithmetic of
    this module.

    Example:
        >>> import jaxmx
        >>> q = quantized(jaxmx.FORMATS["mxfp8_e4m3"], np.full((32,), 480.0, np.float32))
        >>> int(q.scales[0]), float(q.values[0])
        (128, 480.0)
    """
    x = np.asarray(x, np.float32)
    axis = axis % x.ndim
    kind, mode = f.scale_kind.name, f.scale_kind.modes[0]
    logical = tuple(slice(0, n) for n in x.shape)
    if kind == "e8m0":
        data, scales = quantize(x, f, mode, axis, block=f.block)
        values = dequantize(data, scales, axis, x.shape, block=f.block)
        return Quantized(codes=_codes(data, f), scales=scales, global_scale=None, values=values)
    if kind == "float32":
        codes, scales = block_fp8(x, f, mode, axis, block=f.block)
        per_element = np.repeat(scales.astype(np.float64), f.block, axis=axis)
        values = (codes.astype(np.float64) * per_element)[logical]
        return Quantized(codes=codes, scales=scales, global_scale=None, values=values)
    if kind == "e4m3":
        codes, scales, g, values = nvfp4(x, axis, block=f.block, elem_max=f.elem_max)
        return Quantized(
            codes=codes,
            scales=scales,
            global_scale=np.float32(g),
            values=values.astype(np.float64)[logical],
        )
    if kind == "float32_current":
        codes, scales = current_fp8(x, f, axis, mode)
        values = current_fp8_decoded(codes, scales).astype(np.float64)
        return Quantized(codes=codes, scales=scales, global_scale=None, values=values)
    if kind == "float32_pow2":
        xm = np.moveaxis(x, axis, -1)
        xm = np.pad(xm, [(0, 0)] * (xm.ndim - 1) + [(0, -xm.shape[-1] % f.block)])
        blocks = xm.reshape(*xm.shape[:-1], -1, f.block).astype(np.float64)
        scales = np.array(
            [block_fp8_scale(b, f.elem_max, "pow2") for b in blocks.reshape(-1, f.block)]
        )
        scales = scales.reshape(blocks.shape[:-1]).astype(np.float32)
        s = scales.astype(np.float64)[..., None]
        values = (round_to_grid(blocks / s, f) * s).reshape(xm.shape)
        values = np.moveaxis(values, -1, axis)[logical]
        return Quantized(
            codes=None, scales=np.moveaxis(scales, -1, axis), global_scale=None, values=values
        )
    raise ValueError(f"no reference for the scale kind {kind!r} of {f.name}")


def _codes(values: np.ndarray, f) -> np.ndarray:
    """The stored codes of exact element values: the element type's bits in ``f.dtype``, or
    two's-complement integers ``value * 2^mbits``."""
    if np.issubdtype(f.dtype, np.integer) and f.element_dtype is None:
        return np.rint(np.asarray(values, np.float64) * 2.0**f.mbits).astype(f.dtype)
    return np.asarray(values).astype(f.elements).view(f.dtype)
