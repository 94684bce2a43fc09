"""GEMM backends: which exist, which are available here, and what ``"auto"`` runs on each platform.

- ``"emulate"``: exact decode + ``lax.dot_general`` with float32 accumulation; every platform.
- ``"ffi"``: the native custom call: cuBLASLt block-scaled matmul on CUDA devices of compute
  capability >= 10.0 (MXFP8 formats only), the extension's C++ twin on the CPU.
- ``"auto"``: per lowering platform: ``"ffi"`` on CUDA where cuBLASLt MX GEMMs run and every
  operand format is native, ``"emulate"`` everywhere else (the CPU included, so a CPU-placed
  computation on a GPU host is emulated).

Example:
    >>> import jaxmx
    >>> from jaxmx._src.backends import per_platform
    >>> per_platform("emulate", ("mxfp8_e4m3",))
    {'default': 'emulate'}
    >>> sorted(jaxmx.backends())
    ['cublaslt', 'emulate', 'ffi-cpu']
"""

from __future__ import annotations

import functools

import jax

from jaxmx._src import extension

BACKENDS = ("auto", "emulate", "ffi")
"""The values of ``backend=`` / ``Recipe.backend``."""

NATIVE_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2")
"""The formats the native MX GEMM takes, in any pair but E5M2 x E5M2 (cuBLASLt's FP8 type table
has E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3)."""


def native_pair(formats: tuple[str, ...]) -> bool:
    """Whether the native MX GEMM takes operands of these formats."""
    return all(f in NATIVE_FORMATS for f in formats) and set(formats) != {"mxfp8_e5m2"}


_MX_COMPUTE_CAPABILITY = (10, 0)
_MIN_CUBLASLT = 120800  # MX block scaling (VEC32_UE8M0) arrived in cuBLASLt 12.8


def check_backend(backend: str) -> str:
    """Returns ``backend`` if it is one of :data:`BACKENDS`, else raises a ValueError."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    return backend


def per_platform(backend: str, formats: tuple[str, ...]) -> dict[str, str]:
    """The backend that runs on each lowering platform: ``{"default": ..., "cuda": ...}``.

    ``"cuda"`` is present only where it differs from the default, i.e. for ``"auto"`` on a host
    whose CUDA device runs the native MX GEMM, for ``formats`` it takes (:func:`native_pair`).
    """
    check_backend(backend)
    if backend != "auto":
        return {"default": backend}
    if native_pair(formats) and cublaslt_supported():
        return {"default": "emulate", "cuda": "ffi"}
    return {"default": "emulate"}


def backends() -> dict[str, str]:
    """Each GEMM backend mapped to ``"available"`` or the reason it is not on this machine.

    Keys: ``"emulate"`` (pure JAX, always there), ``"ffi-cpu"`` (the C++ CPU handler) and
    ``"cublaslt"`` (the native MX GEMM on the default CUDA device).

    Example:
        >>> import jaxmx
        >>> jaxmx.backends()["emulate"]
        'available'
    """
    return {
        "emulate": "available",
        "ffi-cpu": extension.cpu_status(),
        "cublaslt": _cublaslt_status(),
    }


def cublaslt_supported() -> bool:
    """Whether the native MX GEMM runs on cuBLASLt here (what ``backend="auto"`` uses on CUDA)."""
    return _cublaslt_status() == "available"


@functools.cache
def _cublaslt_status() -> str:
    ext, reason = extension.load()
    if ext is None:
        return reason
    if not ext.has_cuda:
        return (
            "extension built without cuBLASLt (no CUDA headers found at build time; "
            "see docs/native.md)"
        )
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return "no CUDA GPU"
    if not devices:
        return "no CUDA GPU"
    cc = compute_capability(devices[0])
    if cc is None:
        return "could not read the CUDA device's compute capability"
    if cc < _MX_COMPUTE_CAPABILITY:
        return (
            f"device has compute capability {cc[0]}.{cc[1]}; MX block scaling needs >= "
            f"{_MX_COMPUTE_CAPABILITY[0]}.{_MX_COMPUTE_CAPABILITY[1]}"
        )
    libs = ext.cuda_libraries()
    if not libs["loaded"]:
        return libs["error"]
    if libs["cublaslt_version"] < _MIN_CUBLASLT:
        v = libs["cublaslt_version"]
        return f"cuBLASLt {v // 10000}.{v % 10000 // 100} is loaded; MX block scaling needs >= 12.8"
    return "available"


def compute_capability(device) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device, or None where the device does not say."""
    cc = getattr(device, "compute_capability", None)
    try:
        major, minor = str(cc).split(".")[:2]
        return int(major), int(minor)
    except (ValueError, TypeError):
        return None
