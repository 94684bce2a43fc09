"""How the training GEMMs save an MXArray for the backward pass: :class:`MXBits`, its held codes
and scales as unsigned integers of their width (``lax.scan`` stacks integers in place).

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.ones((2, 32)), "mxfp4")
    >>> b = as_bits(q)
    >>> b.data.dtype, b.scale.dtype, bool((from_bits(b).held == q.held).all())
    (dtype('uint8'), dtype('uint8'), True)
"""

from __future__ import annotations

import dataclasses

import jax

from jaxmx._src.core import dtypes, packing
from jaxmx._src.core.formats import get_format
from jaxmx._src.core.mxarray import MXArray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXBits:
    """An MXArray's fields with its held codes and scales viewed as unsigned integers of their
    width (:func:`jaxmx._src.core.dtypes.to_bits`; packed codes stay packed): how the training
    GEMMs save an MXArray for the backward pass (:func:`as_bits`); :func:`from_bits` restores
    it, bit for bit."""

    data: jax.Array
    scale: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    tile: tuple[int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))
    global_scale: jax.Array | None = None


def as_bits(q: MXArray) -> MXBits:
    """``q`` as :class:`MXBits`."""
    data, scale = dtypes.to_bits(q.held), dtypes.to_bits(q.scale)
    return MXBits(data, scale, q.fmt, q.axis, q.shape, q.tile, q.global_scale)


def from_bits(b: MXBits) -> MXArray:
    """The MXArray that :func:`as_bits` made ``b`` from."""
    f = get_format(b.fmt)
    held = dtypes.from_bits(b.data, packing.held_dtype(f))
    scale = dtypes.from_bits(b.scale, f.scale_dtype)
    return MXArray.from_held(held, scale, b.fmt, b.axis, b.shape, b.tile, b.global_scale)
