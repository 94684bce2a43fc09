"""A quantized weight's peer tensors to and from one MXArray, with no decode: codes and scales
are copied, padded or cropped, and (FP4) unpacked or packed two per byte; scale conventions are
converted only where the conversion is exact.

Each layout of :data:`~jaxmx._src.checkpoints.scheme.LAYOUTS` maps to the jaxmx format with the
same bits:

=========================  ======================================================================
layout                     MXArray
=========================  ======================================================================
``block`` (bn, bk)         ``fp8_e4m3_block``, ``tile=(bn, bk)``, float32 decode scales
``tensor``                 ``fp8_e4m3_block``, one tile over the whole ``[out, in]``
``channel``                ``fp8_e4m3_block``, ``tile=(1, in)``: one scale per output row
``mxfp8`` / ``mxfp4``      ``mxfp8_e4m3`` / ``mxfp4``, E8M0 scales per 32 along ``in``
``nvfp4``                  ``nvfp4``, E4M3 scales per 16 along ``in``, float32 tensor scale
=========================  ======================================================================

Example:
    >>> import numpy as np, ml_dtypes
    >>> from jaxmx._src.checkpoints.scheme import Scheme
    >>> codes = np.ones((3, 4), ml_dtypes.float8_e4m3fn)
    >>> q = to_mxarray(Scheme(method="fp8", weights="tensor"), "w",
    ...                codes, np.array(0.5, np.float32), None)
    >>> q.fmt, q.tile, q.scale.tolist()
    ('fp8_e4m3_block', (3, 4), [[0.5]])
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np

from jaxmx._src.checkpoints.safetensors_files import CheckpointError
from jaxmx._src.checkpoints.scheme import Scheme
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.sizes import ceil_div, round_up

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
_FLOAT_SCALES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


def to_mxarray(
    scheme: Scheme, name: str, weight, scale, global_scale, *, inexact: str = "raise"
) -> MXArray:
    """The MXArray (numpy leaves) of the weight ``name`` stored as ``weight`` (codes: E4M3, or
    uint8 with two E2M1 codes per byte), ``scale`` and, for NVFP4, ``global_scale``; a
    :class:`CheckpointError` naming ``name`` when they do not fit ``scheme``. ``inexact``: what
    an encode-factor tensor scale without an exact float32 reciprocal does, ``"raise"`` or
    ``"warn"`` (then its nearest reciprocal is loaded, with a warning naming ``name``)."""
    layout = scheme.weights
    if layout in ("mxfp4", "nvfp4"):
        codes = _unpacked(_checked_dtype(weight, np.uint8, name), name)
    else:
        codes = _checked_dtype(weight, E4M3, name)
    if codes.ndim < 2:
        raise CheckpointError(f"{name}: a quantized weight is [..., out, in], got {codes.shape}")
    out, k = codes.shape[-2:]
    if layout in ("block", "tensor", "channel"):
        tile = {"block": scheme.block_size, "tensor": (out, k), "channel": (1, k)}[layout]
        grid = _float_scales(scale, codes.shape, tile, layout, name)
        return MXArray(
            _padded(codes, tile), grid, "fp8_e4m3_block", codes.ndim - 1, codes.shape, tile
        )
    block = 16 if layout == "nvfp4" else 32
    want = (*codes.shape[:-1], ceil_div(k, block))
    if layout in ("mxfp4", "nvfp4"):
        _check_packable(name, layout, k)
    if layout == "nvfp4":
        scales = _checked_dtype(scale, E4M3, f"{name}'s scales")
        g = _tensor_scale(scheme, global_scale, name, inexact)
    else:
        scales = _e8m0(scale, name)
        g = None
    _check_shape(scales, want, f"{name}'s scales")
    fmt = {"mxfp8": "mxfp8_e4m3", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}[layout]
    return MXArray(_padded(codes, (1, block)), scales, fmt, codes.ndim - 1, codes.shape, None, g)


def from_mxarray(
    scheme: Scheme, name: str, q: MXArray, kept_tensor_scale=None
) -> tuple[np.ndarray, ...]:
    """``(weight, scale)`` or, for NVFP4, ``(weight, scale, tensor scale)`` as ``scheme``
    stores the MXArray ``q`` (numpy); a :class:`CheckpointError` naming ``name`` where ``q`` is
    not in the scheme's layout or a scale does not convert exactly. ``kept_tensor_scale``: the
    encode factor :func:`to_mxarray` loaded inexactly, written back while ``q``'s tensor scale
    is still its nearest reciprocal."""
    layout = scheme.weights
    fmt = {"mxfp8": "mxfp8_e4m3", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}.get(layout, "fp8_e4m3_block")
    if q.fmt != fmt:
        raise CheckpointError(
            f"{name}: a {scheme.method} {layout} checkpoint stores {fmt} weights, got {q.fmt}"
        )
    if q.ndim < 2 or q.axis != q.ndim - 1:
        raise CheckpointError(f"{name}: a stored weight is [..., out, in] blocked along in")
    out, k = q.shape[-2:]
    data = np.asarray(q.data)[..., :out, :k]
    if layout in ("block", "tensor", "channel"):
        tile = {"block": scheme.block_size, "tensor": (out, k), "channel": (1, k)}[layout]
        if q.tile != tile:
            raise CheckpointError(
                f"{name}: {layout} weights take {tile} tiles, the MXArray has {q.tile}"
            )
        if scheme.method == "fp8" and layout == "block":
            _check_grid_inferable(name, (out, k), tile, written_back=scheme.config is not None)
        return data, _stored_float_scales(np.asarray(q.scale), scheme, layout, name)
    if q.tile is not None:
        raise CheckpointError(f"{name}: {layout} weights are blocked along in, not {q.tile} tiles")
    if layout in ("mxfp4", "nvfp4"):
        _check_packable(name, layout, k)
    if layout == "mxfp4":
        return _packed(data), _e8m0_bytes(np.asarray(q.scale), name)
    if layout == "mxfp8":
        return data, _e8m0_bytes(np.asarray(q.scale), name)
    g = np.asarray(q.global_scale, np.float32)
    if kept_tensor_scale is not None:
        kept = _checked_dtype(kept_tensor_scale, np.float32, f"{name}'s kept tensor scale")
        if kept.size == 1 and np.float32(1) / kept.reshape(()) == g:
            return _packed(data), np.asarray(q.scale), kept.reshape(1)
    return _packed(data), np.asarray(q.scale), _stored_tensor_scale(scheme, g, name)


def _check_packable(name: str, layout: str, k: int) -> None:
    """The FP4 layouts pack whole blocks along ``in`` (the peers refuse partial ones)."""
    block = 16 if layout == "nvfp4" else 32
    if k % block:
        raise CheckpointError(
            f"{name}: {layout.upper()} weights need in ({k}) divisible by their block ({block})"
        )


def _check_grid_inferable(
    name: str, shape: tuple[int, int], block: tuple[int, int], *, written_back: bool
) -> None:
    """transformers' loader infers the block from the scale grid (``rows // grid_rows``), so a
    dimension that the block does not divide, cut into more than one block, would be misread:
    refused, or (``written_back``: the scheme of a loaded checkpoint, which held it so) warned
    about."""
    for dim, b in zip(shape, block, strict=True):
        if dim % b and dim > b:
            message = (
                f"{name}: [{shape[0]}, {shape[1]}] in {list(block)} blocks: transformers' loader "
                "infers the block from the scale grid and would misread this one (its own saver "
                "leaves such weights unquantized)"
            )
            if not written_back:
                raise CheckpointError(f"{message}: keep it in high precision")
            warnings.warn(f"{message}; written back as the loaded checkpoint held it", stacklevel=5)
            return


def _checked_dtype(x, dtype, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != dtype:
        raise CheckpointError(f"{name}: expected {np.dtype(dtype).name} values, got {x.dtype.name}")
    return x


def _check_shape(x: np.ndarray, want: tuple[int, ...], name: str) -> None:
    if tuple(x.shape) != tuple(want):
        raise CheckpointError(f"{name}: expected shape {list(want)}, got {list(x.shape)}")


def _padded(codes: np.ndarray, tile: tuple[int, int]) -> np.ndarray:
    """``codes`` zero-padded to whole tiles of its last two axes (zero codes: MXArray's
    padding)."""
    out, k = codes.shape[-2:]
    pad = [(0, 0)] * (codes.ndim - 2) + [
        (0, round_up(out, tile[0]) - out),
        (0, round_up(k, tile[1]) - k),
    ]
    if not any(p for _, p in pad):
        return codes
    padded = np.zeros([n + p for n, (_, p) in zip(codes.shape, pad, strict=True)], codes.dtype)
    padded[..., :out, :k] = codes
    return padded


def _unpacked(packed: np.ndarray, name: str) -> np.ndarray:
    """E2M1 codes (one per byte, as MXArray holds them) of bytes holding two each, the even
    element in the low nibble (every peer's order)."""
    if packed.ndim < 1:
        raise CheckpointError(f"{name}: packed FP4 codes need at least one axis")
    pairs = np.stack([packed & 0xF, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1]).view(E2M1)


def _packed(codes: np.ndarray) -> np.ndarray:
    nibbles = codes.view(np.uint8)
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


def _float_scales(scale, shape, tile, layout: str, name: str) -> np.ndarray:
    """float32 decode scales ``[..., ceil(out/bn), ceil(in/bk)]`` from the stored ones (float of
    any width, or E8M0 bytes: ``2^(b - 127)``); per tensor and per channel reshaped to that
    grid."""
    scale = np.asarray(scale)
    grid = (*shape[:-2], ceil_div(shape[-2], tile[0]), ceil_div(shape[-1], tile[1]))
    where = f"{name}'s scales"
    if layout == "tensor" and scale.size == 1 and len(shape) == 2:
        scale = scale.reshape(1, 1)  # 0-d (transformers) or [1] (compressed-tensors)
    elif layout == "channel" and tuple(scale.shape) == (*shape[:-1],):
        scale = scale[..., None]
    _check_shape(scale, grid, where)
    if scale.dtype in (E8M0, np.dtype(np.uint8)):
        return _pow2_of_bytes(scale.view(np.uint8), where)
    if scale.dtype not in _FLOAT_SCALES.values():
        raise CheckpointError(f"{where}: float scales expected, got {scale.dtype.name}")
    return scale.astype(np.float32)  # every narrower float is a float32: exact


def _pow2_of_bytes(b: np.ndarray, where: str) -> np.ndarray:
    _refuse_nan_bytes(b, where)
    return np.ldexp(np.float32(1), b.astype(np.int32) - 127).astype(np.float32)


def _refuse_nan_bytes(b: np.ndarray, where: str) -> None:
    if (b == 0xFF).any():
        raise CheckpointError(
            f"{where}: E8M0 byte 0xFF at {np.argwhere(b == 0xFF)[0].tolist()}: the peers' readers "
            "disagree on it (+inf through their uint8 decode, NaN as float8_e8m0fnu), so jaxmx "
            "does not load it"
        )


def _e8m0(scale, name: str) -> np.ndarray:
    scale = np.asarray(scale)
    where = f"{name}'s scales"
    if scale.dtype not in (E8M0, np.dtype(np.uint8)):
        raise CheckpointError(
            f"{where}: E8M0 scales (uint8 or float8_e8m0fnu) expected, got {scale.dtype.name}"
        )
    _refuse_nan_bytes(scale.view(np.uint8), where)
    return scale.view(E8M0)


def _e8m0_bytes(scale: np.ndarray, name: str) -> np.ndarray:
    b = scale.view(np.uint8)
    _refuse_nan_bytes(b, f"{name}'s scales (jaxmx's NaN block)")
    return b


def _tensor_scale(scheme: Scheme, stored, name: str, inexact: str) -> np.ndarray:
    """NVFP4's float32 decode tensor scale ``g`` from ModelOpt's ``weight_scale_2`` (a decode
    factor: copied) or compressed-tensors' ``weight_global_scale`` (an encode factor: ``g`` is
    its float32 reciprocal, loaded only where the reciprocal of ``g`` gives the stored bytes
    back)."""
    where = f"{name}'s tensor scale"
    if stored is None:
        raise CheckpointError(f"{where} is missing")
    stored = _checked_dtype(stored, np.float32, where)
    if stored.size != 1:
        raise CheckpointError(f"{where}: one float32 expected, got shape {list(stored.shape)}")
    value = stored.reshape(())
    if scheme.method == "modelopt":
        return value.copy()
    g = np.float32(1) / value
    if not np.isfinite(g):
        raise CheckpointError(f"{where}: the global scale {float(value)!r} has no finite inverse")
    if np.float32(1) / g != value:
        message = (
            f"{where}: the global scale {float(value)!r} (an encode factor) has no float32 "
            "reciprocal that converts back to it, so jaxmx's decode factor cannot hold it exactly"
        )
        if inexact == "raise":
            raise CheckpointError(
                f"{message} (load(..., inexact_tensor_scales='warn') takes the nearest reciprocal)"
            )
        warnings.warn(
            f"{message}: loaded its nearest reciprocal {float(g)!r}; values may differ "
            "from compressed-tensors' by an ulp; the stored scale is kept beside the MXArray under "
            "its own name, and save writes it back",
            stacklevel=4,
        )
    return np.asarray(g, np.float32)


def _stored_tensor_scale(scheme: Scheme, g: np.ndarray, name: str) -> np.ndarray:
    if scheme.method == "modelopt":
        return g.reshape(())
    encode = np.float32(1) / g
    if not np.isfinite(encode) or np.float32(1) / encode != g:
        raise CheckpointError(
            f"{name}: the tensor scale {float(g)!r} has no float32 reciprocal (compressed-tensors' "
            "encode-factor global scale) that converts back to it"
        )
    return np.asarray([encode], np.float32)


def _stored_float_scales(scale: np.ndarray, scheme: Scheme, layout: str, name: str) -> np.ndarray:
    where = f"{name}'s scales"
    if scheme.scale_dtype == "ue8m0":
        exponent = np.frexp(scale)[1] - 1
        pow2 = np.isfinite(scale) & (scale > 0) & (np.ldexp(np.float32(1), exponent) == scale)
        if not pow2.all() or (exponent < -127).any() or (exponent > 127).any():
            bad = np.argwhere(~pow2)[0].tolist() if not pow2.all() else "?"
            raise CheckpointError(
                f"{where}: ue8m0 stores powers of two in [2^-127, 2^127]; the scale at {bad} is "
                "not one (quantize with scale_mode='pow2')"
            )
        stored = (exponent + 127).astype(np.uint8).view(E8M0)
    else:
        dtype = _FLOAT_SCALES[scheme.scale_dtype]
        stored = scale.astype(dtype)
        same = (stored.astype(np.float32) == scale) | (np.isnan(scale) & np.isnan(stored))
        if not same.all():
            raise CheckpointError(
                f"{where}: the scale {scale[tuple(np.argwhere(~same)[0])]!r} is not exact in "
                f"{scheme.scale_dtype}, the checkpoint's scale dtype"
            )
    if layout == "tensor":
        return stored.reshape(scheme.scale_shape)
    return stored
