"""The one dispatcher: which kernel runs a GEMM on each lowering platform.

:func:`jaxmx.matmul`, :func:`jaxmx.dot_general` (and so einsum, attention and the Flax layers)
describe each GEMM as a :class:`Gemm` and run what :func:`kernels` returns: a kernel name for
the ``"default"`` platform and, where ``backend="auto"`` finds a native GEMM on this machine's
CUDA device (:mod:`~jaxmx._src.gemm.capabilities`), another for ``"cuda"``. The kernels:

- ``"emulate"``: exact decode relative to each row's largest scale, ``lax.dot_general`` with
  float32 accumulation (formats whose products ``code * scale`` are exact, in equal blocks);
- ``"emulate_values"``: the same on operands quantized straight to element values (a caller
  that has not quantized yet, E8M0 scales in 1-D blocks): the same bits in less time;
- ``"emulate_pow2_twin"``: block FP8 with power-of-two scales (a caller that quantizes with
  ``scale_mode="pow2"``) as its MX twin through ``"emulate"``: exact where float32 dequantized
  operands would overflow (a scale of ``2^127`` times 448) or flush (scales below ``2^-126``);
- ``"dequantized"``: float32 dequantized operands (float32 scales, narrow tiles, unequal blocks,
  and grouped GEMMs, which have no native kernel yet);
- ``"limited"``: the modelled limited-precision accumulator (``accum_bits``);
- ``"native"``: the native custom call of the formats' family (``Format.gemm``; the per-tensor
  and per-row FP8 formats' family ``"fp8"`` is :func:`jaxmx.ffi.fp8_matmul`, compute capability
  >= 8.9);
- ``"native_pow2_twin"``: block FP8 with power-of-two scales, re-encoded as its MX twin, on the
  native MX GEMM (a device with the MX GEMM but not the block-FP8 one: Blackwell).
- ``"xla"``: ``jax.lax.scaled_dot`` (XLA's block-scaled dot, ``backend="xla"`` only) on MX and
  NVFP4 operands as stored (:mod:`~jaxmx._src.gemm.scaled_dot`);
- ``"xla_pow2_twin"``: block FP8 with power-of-two scales as its MX twin, through the same.

Example:
    >>> from jaxmx._src.gemm.capabilities import Capabilities
    >>> from jaxmx._src.gemm.dispatch import Gemm, kernels
    >>> kernels(Gemm(formats=("mxfp8_e4m3", "mxfp8_e4m3")))
    {'default': 'emulate'}
    >>> blackwell = Capabilities(compute_capability=(10, 0), cublaslt_version=120800)
    >>> kernels(Gemm(formats=("mxfp8_e4m3", "mxfp8_e5m2")), blackwell)
    {'default': 'emulate', 'cuda': 'native'}
    >>> kernels(Gemm(formats=("fp8_e4m3_block",) * 2, scale_mode="pow2"), blackwell)
    {'default': 'emulate_pow2_twin', 'cuda': 'native_pow2_twin'}
    >>> kernels(Gemm(formats=("mxfp4", "mxfp4"), backend="xla"))
    {'default': 'xla'}
    >>> hopper = Capabilities(compute_capability=(9, 0), cublaslt_version=120900)
    >>> kernels(Gemm(formats=("fp8_e4m3_tensor", "fp8_e5m2_tensor")), hopper)
    {'default': 'dequantized', 'cuda': 'native'}
"""

from __future__ import annotations

import dataclasses

from jaxmx._src.core.formats import Format, get_format
from jaxmx._src.core.recipes import (
    Accumulation,
    check_accumulation,
    check_backend,
    scaled_dot_problem,
)
from jaxmx._src.gemm import capabilities as caps
from jaxmx._src.gemm.capabilities import Capabilities

KERNELS = (
    "emulate",
    "emulate_values",
    "emulate_pow2_twin",
    "dequantized",
    "limited",
    "native",
    "native_pow2_twin",
    "xla",
    "xla_pow2_twin",
)
"""Every kernel :func:`kernels` may choose."""

NATIVE_BLOCK_FP8_TILE = 128
"""The one tile the native block-FP8 GEMM takes (128 x 128, DeepSeek-V3's weight tiles)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemm:
    """What the dispatcher knows of one GEMM."""

    # the operands' format names (lhs, rhs)
    formats: tuple[str, str]
    # the operands' 2-D tiles, None for 1-D blocks
    tiles: tuple[tuple[int, int] | None, tuple[int, int] | None] = (None, None)
    # "auto", "emulate", "ffi" or "xla" (jaxmx.BACKENDS)
    backend: str = "auto"
    # a modelled limited-precision accumulator, or None for float32 accumulation
    accumulation: Accumulation | None = None
    # the scale rule the caller quantizes with, where it does (None: operands come quantized)
    scale_mode: str | None = None
    # the caller can quantize its operands straight to element values
    to_values: bool = False
    # a grouped GEMM (jaxmx.ragged_dot), which has no native kernel yet
    grouped: bool = False


def kernels(gemm: Gemm, capabilities: Capabilities | None = None) -> dict[str, str]:
    """The kernel (one of :data:`KERNELS`) that runs ``gemm`` per lowering platform:
    ``{"default": ...}``, plus ``"cuda"`` where that differs (``backend="auto"`` on a host
    whose CUDA device runs the formats' native GEMM). ``capabilities``: the machine's
    (:func:`~jaxmx._src.gemm.capabilities.current`) by default."""
    backend = check_backend(gemm.backend)
    if gemm.grouped:
        if backend == "ffi":
            raise NotImplementedError(
                "jaxmx.ragged_dot: there is no native grouped MX GEMM yet; use backend='emulate' "
                "or 'auto' (which emulates it)"
            )
        if backend == "xla":
            raise NotImplementedError(
                "jaxmx.ragged_dot: backend='xla' has no grouped GEMM (lax.scaled_dot has no "
                "grouped form, and the per-group loop is not built); use backend='emulate' or "
                "'auto' (which emulates it)"
            )
        return {"default": "dequantized"}
    if gemm.accumulation is not None:
        acc = gemm.accumulation
        check_accumulation(acc.bits, acc.promote_every, gemm.formats, backend, "jaxmx GEMM")
        return {"default": "limited"}
    if backend == "ffi":
        _check_native_formats(gemm.formats)
        return {"default": "native"}
    if backend == "xla":
        return {"default": _scaled_dot(gemm)}
    emulated = {"default": _emulation(gemm)}
    if backend == "emulate":
        return emulated
    native = _native_on_cuda(gemm, capabilities or caps.current())
    return emulated if native is None else {**emulated, "cuda": native}


def _check_native_formats(formats: tuple[str, str]) -> None:
    """A NotImplementedError naming the first of ``formats`` that no native GEMM takes."""
    for name in formats:
        if get_format(name).gemm is None:
            raise NotImplementedError(
                f"jaxmx GEMM, backend='ffi': {name} has no native GEMM (cuBLASLt's block-scaled "
                "matmul takes FP8 and FP4 operands, and documents no FP6 or INT8 one); use "
                "backend='auto' or 'emulate'"
            )


def native_family(formats: tuple[str, ...]) -> str | None:
    """The native GEMM family (``Format.gemm``: ``"mx"``, ``"block_fp8"``, ``"fp4"``, ``"fp8"``)
    that takes operands of these formats, or None: formats of no native GEMM or of two families, two
    scale kinds (MXFP4 with NVFP4: cuBLASLt scales both operands with one mode), or E5M2 x E5M2
    (cuBLASLt's FP8 type table has E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3 only).

    Example:
        >>> native_family(("mxfp8_e4m3", "mxfp8_e5m2")), native_family(("mxfp4", "nvfp4"))
        ('mx', None)
    """
    fs = [get_format(f) for f in formats]
    if not fs or len({f.gemm for f in fs}) != 1 or len({f.scale_kind for f in fs}) != 1:
        return None
    if all(f.dtype.name == "float8_e5m2" for f in fs):
        return None
    return fs[0].gemm


def native_pair(formats: tuple[str, ...]) -> bool:
    """Whether a native GEMM (MX, block FP8, FP4 or per-tensor FP8) takes operands of these
    formats."""
    return native_family(formats) is not None


def _scaled_dot(gemm: Gemm) -> str:
    """The ``lax.scaled_dot`` kernel of ``gemm``, or the ValueError naming what it cannot take."""
    problem = scaled_dot_problem(gemm.formats, gemm.scale_mode)
    if problem:
        raise ValueError(f"jaxmx GEMM, backend='xla': {problem}")
    fs = [get_format(f) for f in gemm.formats]
    if not all(_block_wide(t, f) for t, f in zip(gemm.tiles, fs, strict=True)):
        raise ValueError(
            f"jaxmx GEMM, backend='xla': tiles {gemm.tiles} of {' x '.join(gemm.formats)} have no "
            "1-D form (tiles must be as wide as the block); use backend='emulate'"
        )
    return "xla_pow2_twin" if fs[0].scale_kind.name == "float32" else "xla"


def _emulation(gemm: Gemm) -> str:
    fs = [get_format(f) for f in gemm.formats]
    if gemm.to_values and all(f.scale_kind.pow2 for f in fs) and gemm.tiles == (None, None):
        return "emulate_values"
    if gemm.scale_mode == "pow2" and all(f.pow2_twin and f.block == fs[0].block for f in fs):
        if all(_block_wide(t, f) for t, f in zip(gemm.tiles, fs, strict=True)):
            return "emulate_pow2_twin"
    exact = all(f.scale_kind.exact_products for f in fs) and fs[0].block == fs[1].block
    if exact and all(_block_wide(t, f) for t, f in zip(gemm.tiles, fs, strict=True)):
        return "emulate"
    return "dequantized"


def _native_on_cuda(gemm: Gemm, capabilities: Capabilities) -> str | None:
    family = native_family(gemm.formats)
    fs = [get_format(f) for f in gemm.formats]
    tiles_fit = all(_native_tile(t, f) for t, f in zip(gemm.tiles, fs, strict=True))
    if family is not None and tiles_fit and capabilities.supports(family):
        return "native"
    twins = tuple(f.pow2_twin for f in fs)
    if (
        gemm.scale_mode == "pow2"
        and None not in twins
        and native_family(twins) == "mx"
        and capabilities.supports("mx")
    ):
        return "native_pow2_twin"
    return None


def _block_wide(tile, f: Format) -> bool:
    """Whether operands in ``tile`` have a 1-D form (no tile, or tiles as wide as the block)."""
    return tile is None or tile[1] == f.block


def _native_tile(tile, f: Format) -> bool:
    """Whether the native GEMM takes ``tile``: 128 x 128 for block FP8, block-wide otherwise."""
    if tile is not None and f.gemm == "block_fp8":
        return tuple(tile) == (NATIVE_BLOCK_FP8_TILE, NATIVE_BLOCK_FP8_TILE)
    return _block_wide(tile, f)
