"""The text of the advisor's reports: percentages, log2 spans and aligned columns.

Example:
    >>> print(columns([("level", "underflow"), ("mx32", pct(0.00125))]))
    level  underflow
    mx32   0.125%
"""

from __future__ import annotations

import math


def pct(v: float) -> str:
    """``v`` as a percentage, three significant digits.

    Example:
        >>> pct(0.5)
        '50%'
    """
    return f"{100 * v:.3g}%"


def log2_text(v: float) -> str:
    """``log2(v)`` to one decimal (``"-inf"`` for 0, ``"inf"``, ``"nan"``).

    Example:
        >>> log2_text(1024.0), log2_text(0.0)
        ('10.0', '-inf')
    """
    if math.isnan(v):
        return "nan"
    if v == 0:
        return "-inf"
    return "inf" if math.isinf(v) else f"{math.log2(v):.1f}"


def columns(rows) -> str:
    """``rows`` (tuples of strings of one length) as left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
