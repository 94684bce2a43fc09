"""Block FP8 with power-of-two scales, as MXFP8: the same values, for the MX GEMM of Blackwell.

A block-FP8 scale that is a power of two, ``2^k`` with ``-127 <= k <= 127`` (what
``scale_mode="pow2"`` makes), is an E8M0 scale. So a 1x128 block is four 32-element MX blocks
sharing that scale, and a 128x128 tile is 128 rows of such blocks: the codes stay, the scales
are re-encoded and repeated. That is how ``FP8_BLOCK_POW2`` runs on GPUs that have the MX GEMM
(Blackwell) but not cuBLASLt's float32 block scaling.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.arange(256.0).reshape(2, 128), "fp8_e4m3_block", scale_mode="pow2")
    >>> mx = as_mx(q)
    >>> mx.fmt, mx.scale.shape, bool((jaxmx.dequantize(mx) == jaxmx.dequantize(q)).all())
    ('mxfp8_e4m3', (2, 4), True)
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxmx._src.core import bits, wire
from jaxmx._src.core.blocks import padded_shape, scale_shape
from jaxmx._src.core.formats import FORMATS, get_format
from jaxmx._src.core.mxarray import MXArray, checked
from jaxmx._src.core.mxarray_layouts import untiled

MX_OF_BLOCK = {name: f.pow2_twin for name, f in FORMATS.items() if f.pow2_twin}
"""The MX format with the same elements as each block-FP8 format (``Format.pow2_twin``)."""


def as_mx(q: MXArray) -> MXArray:
    """The MXFP8 array with the values of ``q``, a block-FP8 array whose scales are powers of two.

    The scales are not inspected (under ``jit`` they are not known): for float32 scales that are
    not powers of two the result is wrong. Tiles become 1-D blocks along the last axis.
    """
    q = checked(q, "as_mx")
    if q.fmt not in MX_OF_BLOCK:
        raise ValueError(f"as_mx takes block-FP8 arrays ({sorted(MX_OF_BLOCK)}), got {q.fmt}")
    mx = get_format(MX_OF_BLOCK[q.fmt])
    q = untiled(q)  # tiles -> 1-D blocks along the last axis, each tile's scale per row
    axis = q.data_axis
    data = lax.slice_in_dim(q.data, 0, padded_shape(q.shape, q.axis, mx.block)[q.axis], axis=axis)
    scale = jnp.repeat(q.scale, q.format.block // mx.block, axis=axis)
    scale = lax.slice_in_dim(scale, 0, scale_shape(q.shape, q.axis, mx.block)[q.axis], axis=axis)
    byte = (bits.to_bits(scale) >> bits.MANTISSA_BITS) & 0xFF  # 2^k -> k + 127; 2^-127 -> 0
    e8m0 = wire.from_bytes(byte.astype(jnp.uint8), jnp.float8_e8m0fnu)
    return MXArray(data, e8m0, mx.name, q.axis, q.shape)
