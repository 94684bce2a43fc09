"""MXArray: MX-quantized data plus E8M0 block scales, as a JAX pytree.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.ones((4, 64)), "mxfp8_e4m3")
    >>> q.data.shape, q.scale.shape, q.shape
    ((4, 64), (4, 2), (4, 64))
    >>> jax.tree.leaves(q)[0].dtype
    dtype(float8_e4m3fn)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmx.formats import Format, get_format


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXArray:
    """A tensor quantized in blocks along one axis.

    Attributes:
        data: element codes, the logical shape padded along ``axis`` to a multiple of the block.
        scale: ``float8_e8m0fnu`` block scales; ``data``'s shape with ``axis`` divided by the block.
        fmt: the format name (static).
        axis: the (non-negative) block axis (static).
        shape: the logical, unpadded shape (static).
    """

    data: jax.Array
    scale: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def format(self) -> Format:
        """The :class:`~jaxmx.formats.Format` of the elements."""
        return get_format(self.fmt)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Storage of data and scales in bytes (E2M1 counted as half a byte per element)."""
        bits = 4 if self.data.dtype == jnp.float4_e2m1fn else 8
        return self.data.size * bits // 8 + self.scale.size

    def __repr__(self) -> str:
        return f"MXArray(fmt={self.fmt!r}, shape={self.shape}, axis={self.axis})"
