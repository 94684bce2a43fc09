"""A tree's quantized weights to and from the tensors a checkpoint stores: one weight's codes,
scales and tensor scale read into an MXArray (:func:`weight`), and a whole tree written out as
the stored tensors (:func:`stored`), in the names and layouts of its scheme.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> from jaxmx._src.checkpoints.scheme import Scheme
    >>> w = jaxmx.quantize(jnp.ones((4, 64)), "mxfp8_e4m3")
    >>> out = dict(stored({"proj.weight": w}, Scheme(method="mxfp8", weights="mxfp8")))
    >>> {name: (a.dtype.name, a.shape) for name, a in out.items()}
    {'proj.weight': ('float8_e4m3fn', (4, 64)), 'proj.weight_scale_inv': ('float8_e8m0fnu', (4, 2))}
    >>> entry = Entry(key="proj.weight", names=tuple(out), quantized=True)
    >>> weight(Scheme(method="mxfp8", weights="mxfp8"), entry, list(out.values())).fmt
    'mxfp8_e4m3'
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from jaxmx._src.checkpoints import layouts
from jaxmx._src.checkpoints.entries import Entry, roles
from jaxmx._src.checkpoints.placement import Tensor
from jaxmx._src.checkpoints.safetensors_files import CheckpointError
from jaxmx._src.checkpoints.scheme import Scheme
from jaxmx._src.core.mxarray import MXArray


def weight(
    scheme: Scheme, entry: Entry, arrays: list[np.ndarray], inexact: str = "raise"
) -> MXArray:
    """The MXArray (numpy leaves) of the quantized weight ``entry``, from its stored
    ``arrays`` (codes, scales and, for NVFP4, the tensor scale); ``inexact`` as ``load``'s
    ``inexact_tensor_scales``."""
    codes, scale, *tensor_scale = arrays
    if scheme.method == "mxfp4":
        if codes.ndim < 3 or codes.shape[-1] != 16:
            raise CheckpointError(
                f"{entry.names[0]}: gpt-oss blocks are [..., out, in/32, 16], "
                f"got {list(codes.shape)}"
            )
        codes = codes.reshape(*codes.shape[:-2], codes.shape[-2] * 16)
    g = tensor_scale[0] if tensor_scale else None
    return layouts.to_mxarray(scheme, entry.key, codes, scale, g, inexact=inexact)


def exact_reciprocal(scheme: Scheme, stored_scale: np.ndarray) -> bool:
    """Whether a tensor scale loads exactly: a decode factor (ModelOpt), or an encode factor
    (compressed-tensors) whose float32 reciprocal converts back to it."""
    if scheme.method != "compressed-tensors":
        return True
    value = np.asarray(stored_scale, np.float32).reshape(-1)[0]
    return bool(np.float32(1) / (np.float32(1) / value) == value)


def stored(
    tensors: Mapping[str, Tensor], scheme: Scheme | None
) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, numpy array)`` of every tensor the checkpoint stores, in ``tensors``' order.
    A plain tensor named like an MXArray's tensor scale (an inexactly loaded encode factor, see
    ``load``) is the MXArray's to write."""
    r = None if scheme is None else roles(scheme)
    kept = {}
    if r is not None and r.tensor_scale is not None:
        for name, value in tensors.items():
            extra = name.removesuffix(r.key) + r.tensor_scale
            if isinstance(value, MXArray) and not isinstance(tensors.get(extra, value), MXArray):
                kept[name] = extra
    for name, value in tensors.items():
        if not isinstance(value, MXArray):
            if name not in kept.values():
                yield name, np.asarray(value)
            continue
        if not name.endswith(r.key):
            raise CheckpointError(f"{name}: a quantized weight's name ends in {r.key!r}")
        module = name[: len(name) - len(r.key)] if r.key else name
        kept_scale = np.asarray(tensors[kept[name]]) if name in kept else None
        codes, scale, *tensor_scale = layouts.from_mxarray(scheme, name, value, kept_scale)
        if scheme.method == "mxfp4":
            codes = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 16, 16)
        if scheme.method == "mxfp8" or (scheme.method == "fp8" and scheme.scale_dtype == "ue8m0"):
            scale = scale.view(layouts.E8M0)
        yield module + r.codes, codes
        yield module + r.scale, scale
        if tensor_scale:
            yield module + r.tensor_scale, tensor_scale[0]
