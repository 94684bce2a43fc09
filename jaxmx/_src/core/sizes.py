"""Integer sizes: how many blocks cover a length, and the length padded to whole blocks.

Both take Python ints or integer arrays (traced ones too: only ``//``, ``*`` and unary ``-``).

Example:
    >>> ceil_div(100, 32), round_up(100, 32), round_up(100, 32) - 100   # blocks, length, padding
    (4, 128, 28)
"""

from __future__ import annotations

from typing import TypeVar

Size = TypeVar("Size")  # an int, or an integer array


def ceil_div(n: Size, m: int) -> Size:
    """``ceil(n / m)`` for integers ``n >= 0`` and ``m > 0``: the ``m``-blocks that cover ``n``.

    Example:
        >>> ceil_div(64, 32), ceil_div(65, 32), ceil_div(0, 32)
        (2, 3, 0)
    """
    return -(-n // m)


def round_up(n: Size, m: int) -> Size:
    """``n`` rounded up to a multiple of ``m`` (``n >= 0``, ``m > 0``): ``n`` padded to whole
    ``m``-blocks; ``round_up(n, m) - n`` is the padding.

    Example:
        >>> round_up(64, 32), round_up(65, 32), round_up(0, 32)
        (64, 96, 0)
        >>> import jax.numpy as jnp
        >>> round_up(jnp.array([1, 32, 33]), 32).tolist()
        [32, 32, 64]
    """
    return ceil_div(n, m) * m
