"""The cuBLAS block-scaled scale layout: 128x4 tiles of scale bytes (E8M0, or NVFP4's E4M3).

A compact scale matrix ``S[r, c]`` (r: row of the operand, c: K-block index) of shape [R, C] is
zero-padded to ``Rp = roundup(R, 128)``, ``Cp = roundup(C, 4)`` and stored at

    off(r, c) = ((r // 128) * (Cp // 4) + c // 4) * 512
                + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> s = jnp.arange(6, dtype=jnp.uint8).reshape(2, 3)
    >>> buf = jaxmx.swizzle_scales(s)
    >>> buf.shape, buf[:4].tolist(), buf[16:20].tolist()
    ((512,), [0, 1, 2, 0], [3, 4, 5, 0])
    >>> jaxmx.unswizzle_scales(buf, 2, 3).view(jnp.uint8).tolist()
    [[0, 1, 2], [3, 4, 5]]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmx._src.core import wire
from jaxmx._src.core.explicit_axes import on_explicit_axes
from jaxmx._src.core.sizes import round_up

ROW_TILE = 128
COL_TILE = 4
SWIZZLED_DTYPES = (*wire.SCALE_DTYPES, jnp.dtype(jnp.float8_e4m3fn))
"""The scale dtypes :func:`swizzle_scales` takes: E8M0 (MX), E4M3 (NVFP4) and their bytes."""


def swizzle_scales(scale: jax.Array) -> jax.Array:
    """Compact [..., R, C] E8M0 or E4M3 (or uint8) scales -> [..., Rp * Cp] uint8 in cuBLAS tile
    order."""
    s = wire.as_bytes(scale, "swizzle_scales: scales", SWIZZLED_DTYPES)
    if s.ndim < 2:
        raise ValueError(f"swizzle_scales expects [..., R, C] scales, got shape {s.shape}")
    return on_explicit_axes(_swizzled, s)


def _swizzled(s: jax.Array) -> jax.Array:
    *batch, rows, cols = s.shape
    rp, cp = round_up(rows, ROW_TILE), round_up(cols, COL_TILE)
    s = jnp.pad(s, [(0, 0)] * len(batch) + [(0, rp - rows), (0, cp - cols)])
    # r = r0 * 128 + r1 * 32 + r2, c = c0 * 4 + c1  ->  order (r0, c0, r2, r1, c1)
    s = s.reshape(*batch, rp // 128, 4, 32, cp // 4, 4)
    n = len(batch)
    s = s.transpose(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return s.reshape(*batch, rp * cp)


def unswizzle_scales(buf: jax.Array, rows: int, cols: int, dtype=jnp.float8_e8m0fnu) -> jax.Array:
    """The inverse of :func:`swizzle_scales`: [..., Rp * Cp] bytes -> [..., R, C] scales of
    ``dtype``: ``float8_e8m0fnu`` (default, MX), ``float8_e4m3fn`` (NVFP4) or ``uint8``."""
    if jnp.dtype(dtype) not in SWIZZLED_DTYPES:
        names = ", ".join(d.name for d in SWIZZLED_DTYPES)
        raise TypeError(f"unswizzle_scales: dtype must be one of {names}, got {dtype}")
    for name, n in (("rows", rows), ("cols", cols)):
        if n < 0:
            raise ValueError(f"unswizzle_scales: {name} must be non-negative, got {n}")
    b = wire.as_bytes(buf, "unswizzle_scales: buf", SWIZZLED_DTYPES)
    rp, cp = round_up(rows, ROW_TILE), round_up(cols, COL_TILE)
    if b.ndim < 1 or b.shape[-1] != rp * cp:
        raise ValueError(
            f"a swizzled buffer for {rows}x{cols} scales has {rp * cp} bytes, got shape {b.shape}"
        )
    return wire.from_bytes(on_explicit_axes(_unswizzled, b, rows=rows, cols=cols), dtype)


def _unswizzled(b: jax.Array, rows: int, cols: int) -> jax.Array:
    rp, cp = round_up(rows, ROW_TILE), round_up(cols, COL_TILE)
    *batch, _ = b.shape
    n = len(batch)
    s = b.reshape(*batch, rp // 128, cp // 4, 32, 4, 4)  # (r0, c0, r2, r1, c1)
    s = s.transpose(*range(n), n, n + 3, n + 2, n + 1, n + 4)  # (r0, r1, r2, c0, c1)
    return s.reshape(*batch, rp, cp)[..., :rows, :cols]
