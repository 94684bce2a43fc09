"""How a format's scales are stored and what they are: :class:`ScaleKind`, its five kinds, and
the scale rules each kind takes.

A kind's fields are what every layer reads instead of testing format names (scale dtype, rules,
tensor scale, powers of two, exact products); its arithmetic is one object in
:mod:`jaxmx._src.quantize.scales`. The formats of :mod:`jaxmx._src.core.formats` each name one.

Example:
    >>> from jaxmx._src.core.scale_kinds import E8M0_SCALES, SCALE_MODES
    >>> E8M0_SCALES.name, E8M0_SCALES.pow2, E8M0_SCALES.modes == SCALE_MODES
    ('e8m0', True, True)
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleKind:
    """How a format's scales are stored and what they are: the facts every layer reads instead
    of testing format names. The arithmetic of each kind (its scale rules, its decode) is one
    object in :mod:`jaxmx._src.quantize.scales`.

    Example:
        >>> kind = E4M3_SCALES_TENSOR_SCALED  # NVFP4's
        >>> kind.name, kind.tensor_scale, kind.pow2
        ('e4m3', True, False)
    """

    # the kind's name, the key of its rules in jaxmx._src.quantize.scales
    name: str
    # dtype of the block scales
    dtype: np.dtype
    # the scale rules this kind takes, the default first
    modes: tuple[str, ...]
    # a float32 scale per tensor sits above the block scales (NVFP4)
    tensor_scale: bool = False
    # every block scale is an E8M0 power of two: values are codes times 2^e, exactly (the MX
    # kind; float32 scales that happen to be powers of two do not set it)
    pow2: bool = False
    # every value ``code * block scale`` is exact in float32 (not so for float32 scales)
    exact_products: bool = True
    # the scales are coded per block (E8M0, or E4M3 under a tensor scale), so the block
    # statistics of jaxmx.diagnostics (block_stats, telemetry) describe them
    block_statistics: bool = False


SCALE_MODES = ("rceil", "floor", "ceil", "even")
"""How a block's E8M0 exponent is derived from its absolute maximum.

- ``rceil``: smallest power of two >= amax / elem_max (cuBLAS, TransformerEngine, the NVIDIA
  MXFP8 recipe); the block maximum never saturates. The default.
- ``floor``: OCP MX v1.0, ``floor(log2(amax)) - emax``; the block maximum may saturate.
- ``ceil``: ``ceil(log2(amax)) - emax``.
- ``even``: amax rounded to the element's mantissa width (ties away), then ``floor``.
"""

BLOCK_SCALE_MODES = ("fp32", "pow2")
"""How a block-FP8 block's float32 scale ``s`` is derived from its absolute maximum ``amax``.

- ``fp32``: ``s = amax / elem_max`` (float32 division, round to nearest even), at least 2^-126
  (the smallest normal float32). The default; DeepSeek-V3's recipe.
- ``pow2``: ``s = 2^k``, the smallest power of two with ``amax / 2^k <= elem_max`` (k at least
  -127), computed exactly: the same exponent as the MX ``rceil`` rule.

Both: an all-zero block has ``s = 1``, a block holding NaN or inf has ``s = NaN``.
"""


CURRENT_SCALE_MODES = ("fp32", "pow2")
"""How the float32 scale of a per-tensor or per-row FP8 format (torchao's current scaling) is
derived from the absolute maximum ``amax`` of its tensor or row. The scale multiplies: the codes
are ``x * scale``, the values ``code / scale``.

- ``fp32``: ``scale = float32(elem_max / max(amax, 1e-12))``, the quotient rounded once to
  float32 (as torchao's ``amax_to_scale`` computes it in float64). The default.
- ``pow2``: that scale rounded down to a power of two, ``2^floor(log2(scale))`` (from its bits).

Both: an all-zero tensor or row has ``scale = elem_max / 1e-12`` (and zero codes), one holding
NaN or inf has ``scale = NaN`` (and decodes to NaN).
"""

NVFP4_SCALE_MODES = ("e4m3",)
"""NVFP4's one scale rule (:mod:`jaxmx._src.quantize.nvfp4`): the per-tensor scale
``g = amax / (448 * 6)`` and the block scale ``E4M3((block_amax / 6) / g)``."""

E8M0_SCALES = ScaleKind(
    name="e8m0", dtype=E8M0, modes=SCALE_MODES, pow2=True, block_statistics=True
)
FLOAT32_SCALES = ScaleKind(
    name="float32", dtype=np.dtype(np.float32), modes=BLOCK_SCALE_MODES, exact_products=False
)
E4M3_SCALES_TENSOR_SCALED = ScaleKind(
    name="e4m3", dtype=E4M3, modes=NVFP4_SCALE_MODES, tensor_scale=True, block_statistics=True
)
FLOAT32_CURRENT_SCALES = ScaleKind(
    name="float32_current",
    dtype=np.dtype(np.float32),
    modes=CURRENT_SCALE_MODES,
    exact_products=False,
)
FLOAT32_POW2_SCALES = ScaleKind(name="float32_pow2", dtype=np.dtype(np.float32), modes=("pow2",))
"""Power-of-two scales held as float32, by block FP8's ``"pow2"`` rule (its only rule): E5M6's
scales. Every ``code * scale`` is exact in float32 (12-bit codes, scales at least 2^-127)."""
SCALE_KINDS = (
    E8M0_SCALES,
    FLOAT32_SCALES,
    E4M3_SCALES_TENSOR_SCALED,
    FLOAT32_CURRENT_SCALES,
    FLOAT32_POW2_SCALES,
)
"""Every scale kind, one object each."""
