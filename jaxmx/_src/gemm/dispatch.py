"""The one dispatcher: which kernel runs a GEMM on each lowering platform.

:func:`jaxmx.matmul`, :func:`jaxmx.dot_general` (and so einsum, attention and the Flax layers)
describe each GEMM as a :class:`Gemm` and run (:func:`~jaxmx._src.gemm.kernels.execute`) what
:func:`kernels` returns: ``{platform: Kernel}``, a :class:`~jaxmx._src.gemm.kernels.Kernel` for
the ``"default"`` platform and, where ``backend="auto"`` finds a native GEMM that this machine's
device runs (:mod:`~jaxmx._src.gemm.capabilities`), that kernel for its platform
(``Kernel.platform``: ``"cuda"`` for the cuBLASLt GEMMs). The kernels, each defined beside its
implementation:

- ``emulate`` (:data:`~jaxmx._src.gemm.emulate.EMULATE`): exact decode relative to each row's
  largest scale, ``lax.dot_general`` with float32 accumulation (formats whose products
  ``code * scale`` are exact, in equal blocks);
- ``emulate_values``: the same where a caller that has not quantized yet quantizes straight to
  element values (the MX formats and NVFP4, 1-D blocks; a tiled weight as it is): the same
  bits in less time;
- ``emulate_pow2_twin``: block FP8 with power-of-two scales (a caller that quantizes with
  ``scale_mode="pow2"``) as its MX twin through ``emulate``: exact where float32 dequantized
  operands would overflow (a scale of ``2^127`` times 448) or flush (scales below ``2^-126``);
- ``dequantized`` (:mod:`~jaxmx._src.gemm.dequantized_matmul`): float32 dequantized operands
  (float32 scales, narrow tiles, unequal blocks, and grouped GEMMs, which have no native kernel
  yet);
- ``limited`` (:mod:`~jaxmx._src.gemm.accumulation`): the modelled limited-precision
  accumulator (``accum_bits``);
- ``native``: the native custom call of the formats' family (:data:`NATIVE`, keyed by
  ``Format.gemm``; the per-tensor and per-row FP8 formats' family ``"fp8"`` is
  :func:`jaxmx.ffi.fp8_matmul`, compute capability >= 8.9);
- ``native_pow2_twin``: block FP8 with power-of-two scales, re-encoded as its MX twin, on the
  native MX GEMM (a device with the MX GEMM but not the block-FP8 one: Blackwell).
- ``xla`` (:mod:`~jaxmx._src.gemm.scaled_dot`): ``jax.lax.scaled_dot`` (XLA's block-scaled dot,
  ``backend="xla"`` only) on MX and NVFP4 operands as stored;
- ``xla_pow2_twin``: block FP8 with power-of-two scales as its MX twin, through the same.

Example:
    >>> from jaxmx._src.gemm.capabilities import Capabilities
    >>> from jaxmx._src.gemm.dispatch import Gemm, kernels
    >>> kernels(Gemm(formats=("mxfp8_e4m3", "mxfp8_e4m3")))
    {'default': <Kernel emulate>}
    >>> blackwell = Capabilities(compute_capability=(10, 0), cublaslt_version=120800)
    >>> kernels(Gemm(formats=("mxfp8_e4m3", "mxfp8_e5m2")), blackwell)
    {'default': <Kernel emulate>, 'cuda': <Kernel native>}
    >>> kernels(Gemm(formats=("fp8_e4m3_block",) * 2, scale_mode="pow2"), blackwell)
    {'default': <Kernel emulate_pow2_twin>, 'cuda': <Kernel native_pow2_twin>}
    >>> kernels(Gemm(formats=("mxfp4", "mxfp4"), backend="xla"))
    {'default': <Kernel xla>}
    >>> hopper = Capabilities(compute_capability=(9, 0), cublaslt_version=120900)
    >>> kernels(Gemm(formats=("fp8_e4m3_tensor", "fp8_e5m2_tensor")), hopper)["cuda"].needs
    'fp8'
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
from jaxmx._src.core.support import lacks
from jaxmx._src.gemm import capabilities as caps
from jaxmx._src.gemm import native
from jaxmx._src.gemm.accumulation import LIMITED
from jaxmx._src.gemm.capabilities import Capabilities, native_family
from jaxmx._src.gemm.dequantized_matmul import DEQUANTIZED
from jaxmx._src.gemm.emulate import EMULATE, EMULATE_POW2_TWIN, EMULATE_VALUES
from jaxmx._src.gemm.kernels import Kernel
from jaxmx._src.gemm.scaled_dot import XLA, XLA_POW2_TWIN

NATIVE: dict[str, Kernel] = {
    k.needs: k
    for k in (native.FP8_KERNEL, native.BLOCK_FP8_KERNEL, native.FP4_KERNEL, native.MX_KERNEL)
}
"""The native GEMMs as kernels, keyed by family (``Format.gemm``, a key of
:data:`~jaxmx._src.gemm.capabilities.REQUIREMENTS`). ``backend="ffi"`` on a pair of two families
runs the first of them in this order, whose checks name the operand at fault."""

KERNELS: tuple[Kernel, ...] = (
    EMULATE,
    EMULATE_VALUES,
    EMULATE_POW2_TWIN,
    DEQUANTIZED,
    LIMITED,
    *NATIVE.values(),
    native.MX_POW2_TWIN_KERNEL,
    XLA,
    XLA_POW2_TWIN,
)
"""Every kernel :func:`kernels` may choose."""


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


GROUPED_BACKEND = "emulate"
"""The backend a grouped GEMM (:func:`jaxmx.ragged_dot`) runs with: there is no native grouped
kernel yet, and :func:`kernels` refuses the native and ``lax.scaled_dot`` backends for it."""


def kernels(gemm: Gemm, capabilities: Capabilities | None = None) -> dict[str, Kernel]:
    """The kernel (one of :data:`KERNELS`) that runs ``gemm`` per lowering platform:
    ``{"default": ...}``, plus the native kernel's ``platform`` where that differs
    (``backend="auto"`` on a host whose device runs the formats' native GEMM). ``capabilities``:
    the machine's (:func:`~jaxmx._src.gemm.capabilities.current`) by default."""
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
        return {"default": DEQUANTIZED}
    if gemm.accumulation is not None:
        acc = gemm.accumulation
        check_accumulation(acc.bits, acc.promote_every, gemm.formats, backend, "jaxmx GEMM")
        return {"default": LIMITED}
    if backend == "ffi":
        _check_native_formats(gemm.formats)
        families = {get_format(f).gemm for f in gemm.formats}
        return {"default": next(k for family, k in NATIVE.items() if family in families)}
    if backend == "xla":
        return {"default": _scaled_dot(gemm)}
    emulated = {"default": _emulation(gemm)}
    if backend == "emulate":
        return emulated
    kernel = _native(gemm, capabilities or caps.current())
    return emulated if kernel is None else {**emulated, kernel.platform: kernel}


def _check_native_formats(formats: tuple[str, str]) -> None:
    """A NotImplementedError naming the first of ``formats`` that no native GEMM takes."""
    for name in formats:
        if missing := lacks(get_format(name), "native"):
            raise NotImplementedError(
                f"jaxmx GEMM, backend='ffi': {name} has no native GEMM ({missing}: cuBLASLt's "
                "block-scaled matmul takes FP8 and FP4 operands, and documents no FP6 or INT8 "
                "one); use backend='auto' or 'emulate'"
            )


def _scaled_dot(gemm: Gemm) -> Kernel:
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
    return XLA_POW2_TWIN if fs[0].scale_kind.name == "float32" else XLA


def _emulation(gemm: Gemm) -> Kernel:
    fs = [get_format(f) for f in gemm.formats]
    if gemm.scale_mode == "pow2" and all(f.pow2_twin and f.block == fs[0].block for f in fs):
        if all(_block_wide(t, f) for t, f in zip(gemm.tiles, fs, strict=True)):
            return EMULATE_POW2_TWIN
    exact = all(f.scale_kind.exact_products for f in fs) and fs[0].block == fs[1].block
    if exact and all(_block_wide(t, f) for t, f in zip(gemm.tiles, fs, strict=True)):
        return EMULATE_VALUES if gemm.to_values and all(f.has_grid_values for f in fs) else EMULATE
    return DEQUANTIZED


def _native(gemm: Gemm, capabilities: Capabilities) -> Kernel | None:
    """The native kernel ``backend="auto"`` runs ``gemm`` with where the device runs it."""
    family = native_family(gemm.formats)
    fs = [get_format(f) for f in gemm.formats]
    tiles_fit = all(_native_tile(t, f) for t, f in zip(gemm.tiles, fs, strict=True))
    if family is not None and tiles_fit and capabilities.supports(NATIVE[family].needs):
        return NATIVE[family]
    twins = tuple(f.pow2_twin for f in fs)
    twin = native.MX_POW2_TWIN_KERNEL
    if (
        gemm.scale_mode == "pow2"
        and None not in twins
        and native_family(twins) == twin.needs
        and capabilities.supports(twin.needs)
    ):
        return twin
    return None


def _block_wide(tile, f: Format) -> bool:
    """Whether operands in ``tile`` have a 1-D form (no tile, or tiles as wide as the block)."""
    return tile is None or tile[1] == f.block


def _native_tile(tile, f: Format) -> bool:
    """Whether the native GEMM takes ``tile``: 128 x 128 for block FP8, block-wide otherwise."""
    if tile is not None and f.gemm == "block_fp8":
        return tuple(tile) == (native.BLOCK_TILE, native.BLOCK_TILE)
    return _block_wide(tile, f)
