"""The named results of :func:`jaxmx.quantize_rowwise_colwise`: a GEMM operand's two copies.

``Copies(row, col_t)`` without swizzled scales, ``SwizzledCopies(row, col_t, row_swizzled,
col_t_swizzled)`` with them. Both are NamedTuples (and so pytrees, through ``jax.jit``), so
``row, col_t = quantize_rowwise_colwise(x)`` and the 4-way unpacking keep working, and each
item also has a name.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> row, col_t = jaxmx.quantize_rowwise_colwise(jnp.ones((64, 96)))   # a 2-tuple
    >>> copies = as_copies((row, col_t))
    >>> copies.col_t is col_t, copies == (row, col_t)
    (True, True)
    >>> as_copies((1, 2, 3, 4)).col_t_swizzled
    4
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from jaxmx._src.core.mxarray import MXArray


class Copies(NamedTuple):
    """The two copies of a 2-D ``x`` [M, K] that a training GEMM needs.

    Attributes:
        row: ``x`` quantized along K (axis -1), shape [M, K]: the forward GEMM's operand.
        col_t: ``x.T`` [K, M] quantized along M (its axis -1), physically transposed: the
            weight-gradient GEMM's operand.

    Example:
        >>> Copies(row="r", col_t="c")._fields
        ('row', 'col_t')
    """

    row: MXArray
    col_t: MXArray


class SwizzledCopies(NamedTuple):
    """:class:`Copies` plus both copies' scales in the cuBLAS 128x4 layout (as
    :func:`jaxmx.swizzle_scales` gives them): ``quantize_rowwise_colwise(...,
    swizzled_scales=True)``.

    Attributes:
        row, col_t: as in :class:`Copies`.
        row_swizzled: ``swizzle_scales(row.scale)``, 1-D uint8 or float8_e4m3fn bytes.
        col_t_swizzled: ``swizzle_scales(col_t.scale)``.

    Example:
        >>> s = SwizzledCopies(row="r", col_t="c", row_swizzled="rs", col_t_swizzled="cs")
        >>> s.copies, s[2:]
        (Copies(row='r', col_t='c'), ('rs', 'cs'))
    """

    row: MXArray
    col_t: MXArray
    row_swizzled: jax.Array
    col_t_swizzled: jax.Array

    @property
    def copies(self) -> Copies:
        """The two copies without their swizzled scales."""
        return Copies(self.row, self.col_t)


def as_copies(parts: Sequence[Any]) -> Copies | SwizzledCopies:
    """``parts`` (2 items: row, col_t; or 4: with both swizzled scales) as the NamedTuple of
    that length; a ValueError for any other length.

    Example:
        >>> as_copies(("r", "c"))
        Copies(row='r', col_t='c')
    """
    if len(parts) == len(Copies._fields):
        return Copies(*parts)
    if len(parts) == len(SwizzledCopies._fields):
        return SwizzledCopies(*parts)
    raise ValueError(
        f"as_copies: expected (row, col_t) or (row, col_t, row_swizzled, col_t_swizzled), got "
        f"{len(parts)} items"
    )
