"""GEMM backends: which exist, which are available here, and what ``"auto"`` runs on each platform.

- ``"emulate"``: exact decode + ``lax.dot_general`` with float32 accumulation; every platform.
- ``"ffi"``: the native custom calls: cuBLASLt block-scaled matmul on CUDA devices (MXFP8 and
  FP4 formats on compute capability >= 10.0, block FP8 on 9.x), the extension's C++ twins on the
  CPU.
- ``"auto"``: per lowering platform: ``"ffi"`` on CUDA where cuBLASLt runs the operands' format
  family (MX, block FP8 or FP4), ``"emulate"`` everywhere else (the CPU included, so a CPU-placed
  computation on a GPU host is emulated).

Example:
    >>> import jaxmx
    >>> from jaxmx._src.gemm.backends import per_platform
    >>> per_platform("emulate", ("mxfp8_e4m3",))
    {'default': 'emulate'}
    >>> sorted(jaxmx.backends())
    ['cublaslt', 'cublaslt-block-fp8', 'cublaslt-fp4', 'emulate', 'ffi-cpu', 'native-recipes']
"""

from __future__ import annotations

import functools

import jax

from jaxmx._src.core import recipes
from jaxmx._src.core.recipes import Recipe, check_backend
from jaxmx._src.gemm import extension

NATIVE_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2")
"""The formats the native MX GEMM takes, in any pair but E5M2 x E5M2 (cuBLASLt's FP8 type table
has E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3)."""


BLOCK_FP8_FORMATS = ("fp8_e4m3_block", "fp8_e5m2_block")
"""The formats the native block-FP8 GEMM takes (1x128 blocks or 128x128 tiles, float32 scales),
in any pair but E5M2 x E5M2."""

FP4_FORMATS = ("mxfp4", "nvfp4")
"""The formats the native FP4 GEMM takes: both operands MXFP4 or both NVFP4 (E2M1 codes; E8M0
scales per 32 or E4M3 scales per 16 and a float32 tensor scale)."""

_E5M2 = ("mxfp8_e5m2", "fp8_e5m2_block")


def native_family(formats: tuple[str, ...]) -> str | None:
    """``"mx"``, ``"block_fp8"`` or ``"fp4"``: the native GEMM that takes operands of these
    formats, or None (formats of no native GEMM or of two, E5M2 x E5M2, which cuBLASLt has no
    kernel for, or MXFP4 with NVFP4)."""
    if not formats or all(f in _E5M2 for f in formats):
        return None
    if all(f in FP4_FORMATS for f in formats):
        return "fp4" if len(set(formats)) == 1 else None
    for family, members in (("mx", NATIVE_FORMATS), ("block_fp8", BLOCK_FP8_FORMATS)):
        if all(f in members for f in formats):
            return family
    return None


def native_pair(formats: tuple[str, ...]) -> bool:
    """Whether a native GEMM (MX, block FP8 or FP4) takes operands of these formats."""
    return native_family(formats) is not None


_MX_COMPUTE_CAPABILITY = (10, 0)
_NON_TN_MX_MAJOR = 10  # cuBLASLt's non-TN MXFP8 kernels: 10.x (8.9, 9.x and 12.x are TN only)
_MIN_CUBLASLT = 120800  # MX and FP4 block scaling (VEC32_UE8M0, VEC16_UE4M3): cuBLASLt 12.8
_BLOCK_FP8_MAJOR = 9  # VEC128_32F / BLK128x128_32F: Hopper
_MIN_CUBLASLT_BLOCK_FP8 = 120900


def per_platform(backend: str, formats: tuple[str, ...]) -> dict[str, str]:
    """The backend that runs on each lowering platform: ``{"default": ..., "cuda": ...}``.

    ``"cuda"`` is present only where it differs from the default, i.e. for ``"auto"`` on a host
    whose CUDA device runs the native GEMM of the ``formats``' family (:func:`native_family`).
    """
    check_backend(backend)
    if backend != "auto":
        return {"default": backend}
    family = native_family(formats)
    if family is not None and _family_supported(family):
        return {"default": "emulate", "cuda": "ffi"}
    return {"default": "emulate"}


def _family_supported(family: str) -> bool:
    if family == "fp4":
        return fp4_supported()
    return cublaslt_supported() if family == "mx" else block_fp8_supported()


def backends() -> dict[str, str]:
    """Each GEMM backend mapped to ``"available"`` or the reason it is not on this machine.

    Keys: ``"emulate"`` (pure JAX, always there), ``"ffi-cpu"`` (the C++ CPU handlers),
    ``"cublaslt"`` (the native MX GEMM on the default CUDA device), ``"cublaslt-block-fp8"``
    (the native block-FP8 GEMM there), ``"cublaslt-fp4"`` (the native NVFP4 / MXFP4 GEMM there)
    and ``"native-recipes"``: the built-in recipes whose GEMMs ``backend="auto"`` runs natively
    on that device, or ``"none (...)"``.

    Example:
        >>> import jaxmx
        >>> jaxmx.backends()["emulate"]
        'available'
    """
    return {
        "emulate": "available",
        "ffi-cpu": extension.cpu_status(),
        "cublaslt": _cublaslt_status(),
        "cublaslt-block-fp8": _block_fp8_status(),
        "cublaslt-fp4": _fp4_status(),
        "native-recipes": _native_recipes(),
    }


def pow2_blocks_on_mx(formats: tuple[str, ...], scale_mode: str) -> bool:
    """Whether ``"auto"`` runs block-FP8 GEMMs with power-of-two scales on the native MX GEMM
    here (re-encoded by :func:`jaxmx._src.quantize.pow2_blocks.as_mx`): the CUDA device has the
    MX GEMM but not cuBLASLt's block-FP8 one (Blackwell), and the formats' MX twins are a native
    pair."""
    from jaxmx._src.quantize.pow2_blocks import MX_OF_BLOCK  # it builds on the formats, not on this

    if scale_mode != "pow2" or not formats or not all(f in MX_OF_BLOCK for f in formats):
        return False
    twins = tuple(MX_OF_BLOCK[f] for f in formats)
    return native_family(twins) == "mx" and cublaslt_supported() and not block_fp8_supported()


def _native_recipes() -> str:
    named = {name: r for name, r in sorted(vars(recipes).items()) if isinstance(r, Recipe)}
    native = [
        name
        for name, r in named.items()
        if r.accum_bits is None
        and (
            ((family := native_family((r.fwd, r.grad))) is not None and _family_supported(family))
            or pow2_blocks_on_mx((r.fwd, r.grad), r.scale_mode)
        )
    ]
    if not native:
        return "none (every recipe is emulated on this machine)"
    return ", ".join(native) + " (cuBLASLt)"


def non_tn_mx(capability: tuple[int, int] | None) -> bool:
    """Whether the native MX GEMM takes K-first operands untransposed on a CUDA device of this
    compute capability (``None``: no such device).

    cuBLASLt runs MXFP8 with non-TN layouts on compute capability 10.x (TransformerEngine passes
    them through there); 12.x, like 8.9 and 9.x, has TN kernels only, so elsewhere a K-first
    operand's codes and scales are transposed to TN form before the call.

    Example:
        >>> from jaxmx._src.gemm.backends import non_tn_mx
        >>> non_tn_mx((10, 0)), non_tn_mx((12, 0)), non_tn_mx(None)
        (True, False, False)
    """
    return capability is not None and capability[0] == _NON_TN_MX_MAJOR


def mx_k_first_untransposed() -> bool:
    """Whether :func:`jaxmx.ffi.mx_matmul` passes K-first operands untransposed here: the native
    MX GEMM runs on the default CUDA device (:func:`cublaslt_supported`) and that device takes
    non-TN layouts (:func:`non_tn_mx`). Decided at trace time, for every lowering platform of the
    call (the CPU handler takes both layouts)."""
    return cublaslt_supported() and non_tn_mx(_device_capability()[0])


def cublaslt_supported() -> bool:
    """Whether the native MX GEMM runs on cuBLASLt here (what ``backend="auto"`` uses on CUDA)."""
    return _cublaslt_status() == "available"


def block_fp8_supported() -> bool:
    """Whether the native block-FP8 GEMM runs on cuBLASLt here (``backend="auto"`` on CUDA)."""
    return _block_fp8_status() == "available"


def fp4_supported() -> bool:
    """Whether the native FP4 GEMM (NVFP4, MXFP4) runs on cuBLASLt here (``backend="auto"`` on
    CUDA)."""
    return _fp4_status() == "available"


@functools.cache
def _cublaslt_status() -> str:
    return _blackwell_status("MX block scaling")


@functools.cache
def _fp4_status() -> str:
    return _blackwell_status("FP4 block scaling (NVFP4 / MXFP4)")


def _blackwell_status(what: str) -> str:
    """``"available"`` where the default CUDA device has compute capability >= 10.0 and
    cuBLASLt >= 12.8 is loaded (MXFP8 and FP4 block scaling), else why not."""
    cc, reason = _device_capability()
    if cc is None:
        return reason
    if cc < _MX_COMPUTE_CAPABILITY:
        return (
            f"device has compute capability {cc[0]}.{cc[1]}; {what} needs >= "
            f"{_MX_COMPUTE_CAPABILITY[0]}.{_MX_COMPUTE_CAPABILITY[1]}"
        )
    return _cublaslt_version_status(_MIN_CUBLASLT, what)


@functools.cache
def _block_fp8_status() -> str:
    cc, reason = _device_capability()
    if cc is None:
        return reason
    if cc[0] != _BLOCK_FP8_MAJOR:
        return (
            f"device has compute capability {cc[0]}.{cc[1]}; cuBLASLt's block-FP8 scaling "
            f"(1x128 / 128x128 float32 scales) runs on {_BLOCK_FP8_MAJOR}.x (Hopper)"
        )
    return _cublaslt_version_status(_MIN_CUBLASLT_BLOCK_FP8, "block-FP8 scaling")


def _device_capability() -> tuple[tuple[int, int] | None, str]:
    """(the default CUDA device's compute capability, "") or (None, why there is none)."""
    device, reason = _cuda_device()
    if device is None:
        return None, reason
    cc = compute_capability(device)
    if cc is None:
        return None, "could not read the CUDA device's compute capability"
    return cc, ""


def _cublaslt_version_status(minimum: int, what: str) -> str:
    libs = extension.load()[0].cuda_libraries()
    if not libs["loaded"]:
        return libs["error"]
    v = libs["cublaslt_version"]
    if v < minimum:
        return (
            f"cuBLASLt {v // 10000}.{v % 10000 // 100} is loaded; {what} needs >= "
            f"{minimum // 10000}.{minimum % 10000 // 100}"
        )
    return "available"


def _cuda_device():
    """(the default CUDA device, "") where the extension has cuBLASLt handlers and there is one,
    else (None, why not)."""
    ext, reason = extension.load()
    if ext is None:
        return None, reason
    if not ext.has_cuda:
        return None, (
            "extension built without cuBLASLt (no CUDA headers found at build time; "
            "see docs/native.md)"
        )
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return None, "no CUDA GPU"
    if not devices:
        return None, "no CUDA GPU"
    return devices[0], ""


def compute_capability(device) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device, or None where the device does not say."""
    cc = getattr(device, "compute_capability", None)
    try:
        major, minor = str(cc).split(".")[:2]
        return int(major), int(minor)
    except (ValueError, TypeError):
        return None
