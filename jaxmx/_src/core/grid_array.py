"""GridArray: a quantization held as element values on the element grid, and its scales.

What the emulated GEMM consumes where an operand is quantized only to be decoded again in the
same step (``jaxmx._src.quantize.fake.quantize_to_grid`` makes one, for the formats in 1-D blocks
whose products ``code * scale`` are exact: MX and NVFP4): the values a decode of
the codes would give, without the codes.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.quantize.fake import quantize_to_grid
    >>> g = quantize_to_grid(jnp.array([1.0, 0.3] + [0.0] * 30))
    >>> g.data[:2].tolist(), g.scale.view(jnp.uint8).tolist()   # units of the scale 2^-8
    ([256.0, 80.0], [119])
"""

from __future__ import annotations

import dataclasses

import jax

from jaxmx._src.core.mxarray import MXArray, checked_fields, register_pytree


@register_pytree
@dataclasses.dataclass(frozen=True)
class GridArray:
    """A quantization in 1-D blocks (the MX formats, NVFP4) held as element values instead of
    codes (fields as :class:`MXArray`).

    ``data`` is float32, shaped like an MXArray's codes (padded along ``axis``, padding zero),
    each element the decoded value of its code: on the element grid, within ``±elem_max``.
    ``scale`` holds the block scales (E8M0; NVFP4's E4M3), ``global_scale`` NVFP4's tensor
    scale (None for the others). Only jaxmx's emulated GEMM consumes it. The constructor checks
    the fields against each other as :class:`MXArray`'s does.
    """

    data: jax.Array
    scale: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    global_scale: jax.Array | None = None

    def __post_init__(self):
        fmt, axis, shape, _ = checked_fields(self, "GridArray")
        for name, value in (("fmt", fmt), ("axis", axis), ("shape", shape)):
            object.__setattr__(self, name, value)

    format = MXArray.format
    ndim = MXArray.ndim
    data_axis = MXArray.data_axis
