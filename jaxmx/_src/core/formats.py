"""Block-scaled element formats: the static facts a quantizer and a GEMM need about each one.

The OCP MX formats (32-element blocks, E8M0 power-of-two scales: MXFP8, MXFP6, MXFP4, MXINT8),
the block-FP8 formats of
DeepSeek-V3's recipe (128-element blocks or 128x128 tiles, float32 scales) and NVFP4 (E2M1 in
16-element blocks, E4M3 block scales and one float32 scale per tensor), and FP8 with one float32
scale per tensor or per row (torchao's tensorwise and axiswise current scaling). One storage-only
format: DeepSeek-V3's E5M6 (12-bit codes in ``uint16``, power-of-two scales per 128 elements), for
activations saved for the backward pass, never a GEMM operand.

Example:
    >>> from jaxmx._src.core.formats import get_format
    >>> f = get_format("mxfp8_e4m3")
    >>> f.elem_max, f.block, f.is_fp8, f.has_inf
    (448.0, 32, True, False)
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from jaxmx._src.core.scale_kinds import (
    E4M3_SCALES_TENSOR_SCALED,
    E8M0_SCALES,
    FLOAT32_CURRENT_SCALES,
    FLOAT32_POW2_SCALES,
    FLOAT32_SCALES,
    ScaleKind,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Format:
    """A block-scaled element format.

    Attributes:
        name: the public name, e.g. ``"mxfp8_e4m3"``.
        dtype: the dtype the element codes are stored in (``float8_e4m3fn``, ``float8_e5m2``,
            ``float4_e2m1fn``, ``int8``; ``uint8`` for FP6, whose dtypes XLA does not take: the
            6-bit code in the low bits of a byte).
        element_dtype: the element type itself where it differs from ``dtype`` (ml_dtypes'
            ``float6_e2m3fn`` / ``float6_e3m2fn`` for codes held in ``uint8``), else ``None``.
        elem_max: the largest finite element magnitude.
        emax: exponent of the largest power of two in the element format.
        mbits: explicit mantissa bits of the element format (MXINT8: 6, the fraction bits of its
            two's-complement code times the implicit 2^-6).
        emin: exponent of the smallest normal element (subnormals share its quantum; MXINT8:
            0, so every element is a multiple of 2^(emin - mbits) = 2^-6).
        block: elements per scale along the block axis (32 for every OCP MX format, 128 for
            block FP8, 16 for NVFP4); 1 where ``span`` is not ``"block"`` (no padding, no
            block alignment to keep).
        scale_kind: how the scales are stored (:class:`ScaleKind`): E8M0 powers of two (the
            MX formats), float32 (block FP8), or E4M3 under a float32 tensor scale (NVFP4).
        gemm: the native GEMM family that takes the format (``"mx"``, ``"block_fp8"``,
            ``"fp4"``, ``"fp8"``: the per-tensor / per-row formats on cuBLASLt's per-tensor FP8
            GEMM), or ``None``.
        span: what one scale covers: ``"block"`` (``block`` elements along the block axis),
            ``"row"`` (the whole block axis: one scale per index of the other axes) or
            ``"tensor"`` (the whole tensor: one scale).
        pow2_twin: for a format whose power-of-two scaled arrays are also arrays of another
            format with the same codes (block FP8 with ``"pow2"`` scales as MXFP8 in 32-blocks),
            that format's name; else ``None``.
        code_bits: the width of a float element held in the low bits of a wider integer
            ``dtype`` with no ml_dtypes type of its own (E5M6: 12 bits in ``uint16``), else
            ``None``. Such elements are IEEE-like: subnormals, and the all-ones exponent holds
            inf (mantissa zero) and NaN (the rest).
        gemm_operand: ``False`` for a storage-only format (E5M6): ``quantize`` and
            ``dequantize`` take it, every GEMM and recipe refuses it by name
            (:func:`check_gemm_operand`).
    """

    name: str
    dtype: np.dtype
    elem_max: float
    emax: int
    mbits: int
    emin: int
    block: int
    scale_kind: ScaleKind
    element_dtype: np.dtype | None = None
    gemm: str | None = None
    span: str = "block"
    pow2_twin: str | None = None
    code_bits: int | None = None
    gemm_operand: bool = True

    def __post_init__(self):
        if self.span not in SPANS:
            raise ValueError(f"Format.span must be one of {SPANS}, got {self.span!r}")

    @property
    def scale_dtype(self) -> np.dtype:
        """The dtype of the block scales (the scale kind's)."""
        return self.scale_kind.dtype

    @property
    def is_mx(self) -> bool:
        """Whether scales are E8M0 powers of two (the OCP MX formats: MXFP8, MXFP6, MXFP4,
        MXINT8), not float32 (block FP8) or E4M3 under a tensor scale (NVFP4)."""
        return self.scale_kind.pow2

    @property
    def has_grid_values(self) -> bool:
        """Whether a quantization may be held as element values (a GridArray) for the emulated
        GEMM: 1-D blocks of a GEMM operand whose products ``code * scale`` are exact and whose
        rows decode relative to their largest scale (the MX formats and NVFP4)."""
        kind = self.scale_kind
        return self.span == "block" and self.gemm_operand and (kind.pow2 or kind.tensor_scale)

    @property
    def scale_modes(self) -> tuple[str, ...]:
        """The scale rules this format takes (the first is the default)."""
        return self.scale_kind.modes

    @property
    def has_global_scale(self) -> bool:
        """Whether a float32 per-tensor scale sits above the block scales (NVFP4)."""
        return self.scale_kind.tensor_scale

    @property
    def has_block_statistics(self) -> bool:
        """Whether the diagnostics' block statistics cover the format (its scale kind's
        :attr:`ScaleKind.block_statistics`: the MX formats and NVFP4)."""
        return self.scale_kind.block_statistics

    @property
    def elem_max_mantissa(self) -> int:
        """The 23-bit float32 mantissa field of ``elem_max`` (used by rceil)."""
        return int(np.float32(self.elem_max).view(np.uint32)) & 0x7FFFFF

    @property
    def elements(self) -> np.dtype:
        """The element type: :attr:`element_dtype`, or the storage ``dtype`` itself."""
        return self.dtype if self.element_dtype is None else self.element_dtype

    @property
    def is_integer(self) -> bool:
        """Whether elements are two's-complement integers (MXINT8: ``code * 2^-mbits``)."""
        return self.code_bits is None and bool(np.issubdtype(self.elements, np.integer))

    @property
    def is_fp8(self) -> bool:
        """Whether elements are 8-bit floats."""
        return not self.is_integer and self.bits == 8

    @property
    def coding(self) -> str:
        """How elements are held as codes, one of :data:`CODINGS`: ``"bytes"`` (floats one per
        byte: FP8, FP6 in ``uint8``), ``"words"`` (floats in the low bits of 16-bit integers: E5M6
        in ``uint16``), both encoded by integer arithmetic on their bits; ``"integers"``
        (two's-complement, MXINT8); ``"cast"`` (a dtype XLA casts to: E2M1).

        Example:
            >>> [get_format(n).coding for n in ("mxfp8_e4m3", "mxint8", "mxfp4")]
            ['bytes', 'integers', 'cast']
        """
        if self.is_integer:
            return "integers"
        if self.code_bits is not None and self.storage_bits == 16:
            return "words"
        return "bytes" if self.storage_bits == 8 else "cast"

    @property
    def has_inf(self) -> bool:
        """Whether the element format has infinities (IEEE-style specials: E5M2)."""
        if self.is_integer:
            return False
        if self.code_bits is not None:
            return True
        return bool(np.isinf(np.array(np.inf).astype(self.elements)))

    @property
    def bits(self) -> int:
        """Bits per element (6 for FP6, stored in 8; 12 for E5M6, stored in 16: see
        :attr:`storage_bits`)."""
        return self.code_bits if self.code_bits is not None else _bits(self.elements)

    @property
    def storage_bits(self) -> int:
        """Bits of the code ``dtype`` (E2M1 4, FP6 8: its ``uint8``, E5M6 16). At rest an
        MXArray holds :attr:`packing`'s groups instead: :attr:`bits_at_rest`."""
        return _bits(self.dtype)

    @property
    def packing(self) -> tuple[int, int] | None:
        """``(codes, bytes)``: how many codes an MXArray holds in how many bytes, along its block
        axis (:mod:`jaxmx._src.core.packing`): ``(2, 1)`` for 4-bit codes, ``(4, 3)`` for FP6;
        ``None`` where each code is held in its own ``dtype`` (8-bit codes, E5M6 in ``uint16``)."""
        if self.storage_bits == 4:
            return 2, 1
        if self.bits == 6:
            return 4, 3
        return None

    @property
    def bits_at_rest(self) -> int:
        """Bits an MXArray holds per element (4 for E2M1, 6 for FP6, else :attr:`storage_bits`).

        Example:
            >>> [get_format(n).bits_at_rest for n in ("mxfp4", "mxfp6_e2m3", "mxfp8_e4m3")]
            [4, 6, 8]
        """
        if self.packing is None:
            return self.storage_bits
        codes, held = self.packing
        return 8 * held // codes


def _bits(dtype) -> int:
    """The width of an integer or float dtype in bits."""
    if np.issubdtype(dtype, np.integer):
        return np.iinfo(dtype).bits
    return ml_dtypes.finfo(dtype).bits


CODINGS = ("bytes", "words", "integers", "cast")
"""How a format's elements are held as codes (:attr:`Format.coding`)."""

SPANS = ("block", "row", "tensor")
"""What one scale of a format covers (:attr:`Format.span`)."""

_E4M3_ELEMENTS = dict(
    dtype=np.dtype(ml_dtypes.float8_e4m3fn), elem_max=448.0, emax=8, mbits=3, emin=-6
)
_E5M2_ELEMENTS = dict(
    dtype=np.dtype(ml_dtypes.float8_e5m2), elem_max=57344.0, emax=15, mbits=2, emin=-14
)
_E2M1_ELEMENTS = dict(
    dtype=np.dtype(ml_dtypes.float4_e2m1fn), elem_max=6.0, emax=2, mbits=1, emin=0
)
_E2M3_ELEMENTS = dict(
    dtype=np.dtype(np.uint8),
    element_dtype=np.dtype(ml_dtypes.float6_e2m3fn),
    elem_max=7.5,
    emax=2,
    mbits=3,
    emin=0,
)
_E3M2_ELEMENTS = dict(
    dtype=np.dtype(np.uint8),
    element_dtype=np.dtype(ml_dtypes.float6_e3m2fn),
    elem_max=28.0,
    emax=4,
    mbits=2,
    emin=-2,
)
# DeepSeek-V3's E5M6: 1 sign, 5 exponent (bias 15), 6 mantissa bits, IEEE-like (inf and NaN in
# the all-ones exponent), largest finite (2 - 2^-6) * 2^15; 12-bit codes in the low bits of uint16
_E5M6_ELEMENTS = dict(
    dtype=np.dtype(np.uint16), code_bits=12, elem_max=65024.0, emax=15, mbits=6, emin=-14
)
# MXINT8 as Microsoft's microxcaling implements it: int8 codes times 2^-6, symmetric +-127
_INT8_ELEMENTS = dict(dtype=np.dtype(np.int8), elem_max=127 / 64, emax=0, mbits=6, emin=0)

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format(name="mxfp8_e4m3", **_E4M3_ELEMENTS, block=32, scale_kind=E8M0_SCALES, gemm="mx"),
        Format(name="mxfp8_e5m2", **_E5M2_ELEMENTS, block=32, scale_kind=E8M0_SCALES, gemm="mx"),
        Format(name="mxfp4", **_E2M1_ELEMENTS, block=32, scale_kind=E8M0_SCALES, gemm="fp4"),
        Format(name="mxfp6_e2m3", **_E2M3_ELEMENTS, block=32, scale_kind=E8M0_SCALES),
        Format(name="mxfp6_e3m2", **_E3M2_ELEMENTS, block=32, scale_kind=E8M0_SCALES),
        Format(name="mxint8", **_INT8_ELEMENTS, block=32, scale_kind=E8M0_SCALES),
        Format(
            name="fp8_e4m3_block",
            **_E4M3_ELEMENTS,
            block=128,
            scale_kind=FLOAT32_SCALES,
            gemm="block_fp8",
            pow2_twin="mxfp8_e4m3",
        ),
        Format(
            name="fp8_e5m2_block",
            **_E5M2_ELEMENTS,
            block=128,
            scale_kind=FLOAT32_SCALES,
            gemm="block_fp8",
            pow2_twin="mxfp8_e5m2",
        ),
        Format(
            name="nvfp4",
            **_E2M1_ELEMENTS,
            block=16,
            scale_kind=E4M3_SCALES_TENSOR_SCALED,
            gemm="fp4",
        ),
        *(
            Format(
                name=f"fp8_{elements}_{span}",
                **facts,
                block=1,
                scale_kind=FLOAT32_CURRENT_SCALES,
                gemm="fp8",
                span=span,
            )
            for span in ("tensor", "row")
            for elements, facts in (("e4m3", _E4M3_ELEMENTS), ("e5m2", _E5M2_ELEMENTS))
        ),
        Format(
            name="e5m6_block",
            **_E5M6_ELEMENTS,
            block=128,
            scale_kind=FLOAT32_POW2_SCALES,
            gemm_operand=False,
        ),
    )
}
"""Every format jaxmx knows, by name. Adding one: an entry here, of an existing
:class:`ScaleKind` or of a new one (with its rules in :mod:`jaxmx._src.quantize.scales`)."""


SAVE_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "fp8_e4m3_block", "fp8_e5m2_block", "e5m6_block")
"""The formats ``jaxmx.save_quantized`` keeps inputs in: MXFP8 (E8M0 scale per 32), block FP8
(float32 scale per 128) and E5M6 (12-bit codes packed two per three bytes, power-of-two scale
per 128)."""


def formats_of(*, gemm: str) -> tuple[str, ...]:
    """The names of the formats of a native GEMM family, in table order.

    Example:
        >>> formats_of(gemm="block_fp8")
        ('fp8_e4m3_block', 'fp8_e5m2_block')
    """
    return tuple(name for name, f in FORMATS.items() if f.gemm == gemm)


def check_gemm_operand(f: Format, where: str) -> Format:
    """``f`` if a GEMM takes it as an operand, else a ValueError naming it and ``where``.

    Example:
        >>> check_gemm_operand(get_format("mxfp8_e4m3"), "Recipe.fwd").name
        'mxfp8_e4m3'
        >>> get_format("e5m6_block").gemm_operand  # check_gemm_operand raises for it
        False
    """
    if not f.gemm_operand:
        raise ValueError(
            f"{where}: {f.name} is a storage-only format (activations saved for the backward "
            "pass: jaxmx.save_quantized), not a GEMM operand"
        )
    return f


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


def check_scale_mode(scale_mode: str | None, fmt: str | Format = "mxfp8_e4m3") -> str:
    """``scale_mode`` if ``fmt`` takes it (``None``: the format's default), else a ValueError
    naming the choices."""
    f = get_format(fmt)
    if scale_mode is None:
        return f.scale_modes[0]
    if not isinstance(scale_mode, str) or scale_mode not in f.scale_modes:
        raise ValueError(
            f"unknown scale_mode {scale_mode!r} for {f.name}; expected one of {f.scale_modes}"
        )
    return scale_mode
