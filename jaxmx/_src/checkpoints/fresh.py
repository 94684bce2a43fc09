"""Weights quantized afresh in a checkpoint's layout: what ``quantize`` call gives an ``[out,
in]`` weight the bits a :class:`~jaxmx._src.checkpoints.scheme.Scheme` stores, for a weight that
has no earlier quantization to keep the scales of (:func:`jaxmx.requantize` keeps them).

=====================  ===========================================================================
``scheme.weights``     quantization of the ``[N, K]`` weight (blocked along K)
=====================  ===========================================================================
``block`` (bn, bk)     ``fp8_e4m3_block``, ``tile=(bn, bk)``; ``scale_mode="pow2"`` for ``ue8m0``
``tensor``             ``fp8_e4m3_block``, ``tile=(N, K)``: one scale
``channel``            ``fp8_e4m3_block``, ``tile=(1, K)``: one scale per output row
``mxfp8`` / ``mxfp4``  ``mxfp8_e4m3`` / ``mxfp4``
``nvfp4``              ``nvfp4`` (with its float32 tensor scale)
=====================  ===========================================================================

Two peers store a scale jaxmx computes in float32 in a narrower form, which :func:`quantized_weight`
respects so that the weight can be written exactly: compressed-tensors' bfloat16 / float16 FP8
scales (each scale rounded up to that dtype, then the weight encoded against the rounded scales),
and compressed-tensors' NVFP4 global scale, an encode factor (the tensor scale is the one
``quantize`` derives if its float32 reciprocal converts back to it, else the power of two above
it, whose reciprocal is exact).

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.checkpoints.scheme import Scheme
    >>> fresh_quantization(Scheme(method="fp8", weights="block", scale_dtype="ue8m0"), (200, 136))
    FreshQuantization(fmt='fp8_e4m3_block', tile=(128, 128), scale_mode='pow2')
    >>> q = quantized_weight(jnp.ones((4, 64)), Scheme(method="compressed-tensors",
    ...                                               weights="channel"))
    >>> q.tile, q.scale.shape
    ((1, 64), (4, 1))
"""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np

from jaxmx._src.checkpoints.safetensors_files import CheckpointError
from jaxmx._src.checkpoints.scheme import Scheme
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.quantize.nvfp4 import tensor_scale
from jaxmx._src.quantize.quantize import quantize
from jaxmx._src.quantize.requantize import requantize

_NARROW_SCALES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FreshQuantization:
    """The :func:`jaxmx.quantize` arguments of a weight in a scheme's layout."""

    fmt: str
    tile: tuple[int, int] | None
    scale_mode: str | None


def fresh_quantization(scheme: Scheme, shape: tuple[int, ...]) -> FreshQuantization:
    """How a 2-D ``[out, in]`` weight of ``shape`` is quantized in ``scheme``'s layout."""
    if len(shape) != 2:
        raise CheckpointError(f"a weight quantized for a checkpoint is [out, in], got {shape}")
    layout = scheme.weights
    if layout in ("block", "tensor", "channel"):
        tile = {"block": scheme.block_size, "tensor": tuple(shape), "channel": (1, shape[1])}
        mode = "pow2" if scheme.scale_dtype == "ue8m0" else "fp32"
        return FreshQuantization(fmt="fp8_e4m3_block", tile=tile[layout], scale_mode=mode)
    fmt = {"mxfp8": "mxfp8_e4m3", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}[layout]
    return FreshQuantization(fmt=fmt, tile=None, scale_mode=None)


def quantized_weight(w: jax.Array, scheme: Scheme, name: str = "weight") -> MXArray:
    """The ``[out, in]`` weight ``w`` quantized afresh in ``scheme``'s layout, with scales the
    scheme stores exactly (``name``: the tensor, for errors)."""
    if np.ndim(w) != 2:
        raise CheckpointError(f"{name}: a quantized weight is [out, in], got shape {np.shape(w)}")
    how = fresh_quantization(scheme, tuple(w.shape))
    if how.fmt == "nvfp4" and scheme.method == "compressed-tensors":
        g = np.float32(tensor_scale(w))
        if not np.isfinite(g) or np.float32(1) / (np.float32(1) / g) != g:
            g = np.ldexp(np.float32(1), int(np.ceil(np.log2(np.float64(g)))))
        return quantize(w, "nvfp4", axis=-1, global_scale=np.float32(g))
    q = quantize(w, how.fmt, axis=-1, scale_mode=how.scale_mode, tile=how.tile)
    narrow = _NARROW_SCALES.get(scheme.scale_dtype)
    if narrow is None:
        return q
    return requantize(
        w, MXArray(q.data, _rounded_up(q.scale, narrow), q.fmt, q.axis, q.shape, q.tile)
    )


def _rounded_up(scale: jax.Array, dtype: np.dtype) -> np.ndarray:
    """float32 ``scale`` as the least ``dtype`` values at or above each (so every block's values
    still fit), back in float32."""
    s = np.asarray(scale, np.float32)
    narrow = s.astype(dtype)
    below = narrow.astype(np.float32) < s
    narrow[below] = np.nextafter(narrow[below], np.array(np.inf, dtype))
    return narrow.astype(np.float32)
