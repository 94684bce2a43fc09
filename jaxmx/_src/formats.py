"""MX element formats: the static facts a quantizer and a GEMM need about each one.

Example:
    >>> from jaxmx._src.formats import get_format
    >>> f = get_format("mxfp8_e4m3")
    >>> f.elem_max, f.block, f.is_fp8, f.has_inf
    (448.0, 32, True, False)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Format:
    """An MX element format with E8M0 block scales.

    Attributes:
        name: the public name, e.g. ``"mxfp8_e4m3"``.
        dtype: the element dtype (``float8_e4m3fn``, ``float8_e5m2``, ``float4_e2m1fn``).
        elem_max: the largest finite element magnitude.
        emax: exponent of the largest power of two in the element format.
        mbits: explicit mantissa bits of the element format.
        emin: exponent of the smallest normal element (subnormals share its quantum).
        block: elements per scale (32 for every OCP MX format).
    """

    name: str
    dtype: np.dtype
    elem_max: float
    emax: int
    mbits: int
    emin: int
    block: int = 32

    @property
    def elem_max_mantissa(self) -> int:
        """The 23-bit float32 mantissa field of ``elem_max`` (used by rceil)."""
        return int(np.float32(self.elem_max).view(np.uint32)) & 0x7FFFFF

    @property
    def is_fp8(self) -> bool:
        """Whether elements are 8-bit floats (encoded and decoded by integer code)."""
        return jnp.dtype(self.dtype).itemsize == 1 and jnp.dtype(self.dtype).name != "float4_e2m1fn"

    @property
    def has_inf(self) -> bool:
        """Whether the element format has infinities (IEEE-style specials: E5M2)."""
        return bool(np.isinf(np.array(np.inf).astype(self.dtype)))

    @property
    def bits(self) -> int:
        """Storage bits per element."""
        return 4 if jnp.dtype(self.dtype).name == "float4_e2m1fn" else 8


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("mxfp8_e4m3", jnp.dtype(jnp.float8_e4m3fn), 448.0, emax=8, mbits=3, emin=-6),
        Format("mxfp8_e5m2", jnp.dtype(jnp.float8_e5m2), 57344.0, emax=15, mbits=2, emin=-14),
        Format("mxfp4", jnp.dtype(jnp.float4_e2m1fn), 6.0, emax=2, mbits=1, emin=0),
    )
}

SCALE_MODES = ("rceil", "floor", "ceil", "even")
"""How a block's E8M0 exponent is derived from its absolute maximum.

- ``rceil``: smallest power of two >= amax / elem_max (cuBLAS, TransformerEngine, the NVIDIA
  MXFP8 recipe); the block maximum never saturates. The default.
- ``floor``: OCP MX v1.0, ``floor(log2(amax)) - emax``; the block maximum may saturate.
- ``ceil``: ``ceil(log2(amax)) - emax``.
- ``even``: amax rounded to the element's mantissa width (ties away), then ``floor``.
"""


def get_format(fmt: str | Format) -> Format:
    """Looks a format up by name (or checks a :class:`Format`), with a clear error otherwise.

    Only the formats of :data:`FORMATS` are accepted: a hand-made ``Format`` that is not one of
    them raises, since every part of jaxmx (decode, GEMMs) must know it.
    """
    if isinstance(fmt, Format):
        if FORMATS.get(fmt.name) != fmt:
            raise ValueError(
                f"unknown MX format {fmt!r}; use one of {sorted(FORMATS)} (custom formats are "
                "not supported)"
            )
        return fmt
    if isinstance(fmt, str) and fmt in FORMATS:
        return FORMATS[fmt]
    raise ValueError(f"unknown MX format {fmt!r}; expected one of {sorted(FORMATS)}")


def check_scale_mode(scale_mode: str) -> str:
    """Returns ``scale_mode`` if it is known, else raises a ValueError naming the choices."""
    if not isinstance(scale_mode, str) or scale_mode not in SCALE_MODES:
        raise ValueError(f"unknown scale_mode {scale_mode!r}; expected one of {SCALE_MODES}")
    return scale_mode
