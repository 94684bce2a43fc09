"""The availability report, :func:`jaxmx.backends`: what runs on this machine, in words.

Example:
    >>> import jaxmx
    >>> sorted(jaxmx.backends())
    ['cublaslt', 'cublaslt-block-fp8', 'cublaslt-fp4', 'emulate', 'ffi-cpu', 'native-recipes']
"""

from __future__ import annotations

from jaxmx._src.core import recipes
from jaxmx._src.core.recipes import Recipe
from jaxmx._src.gemm import capabilities, extension
from jaxmx._src.gemm.dispatch import Gemm, kernels
from jaxmx._src.gemm.native import MXFP8_FORMATS

NATIVE_FORMATS = MXFP8_FORMATS
"""The former name of :data:`MXFP8_FORMATS` (the native MX GEMM takes the MXFP8 formats only)."""


def mx_supported() -> bool:
    """Whether the native MX (MXFP8) GEMM runs on cuBLASLt here (what ``backend="auto"`` uses on
    CUDA)."""
    return capabilities.current().supports("mx")


def block_fp8_supported() -> bool:
    """Whether the native block-FP8 GEMM runs on cuBLASLt here (``backend="auto"`` on CUDA)."""
    return capabilities.current().supports("block_fp8")


def fp4_supported() -> bool:
    """Whether the native FP4 GEMM (NVFP4, MXFP4) runs on cuBLASLt here (``backend="auto"`` on
    CUDA)."""
    return capabilities.current().supports("fp4")


def fp8_supported() -> bool:
    """Whether the per-tensor FP8 GEMM (:func:`fp8_matmul`) runs on cuBLASLt here."""
    return capabilities.current().supports("fp8")


cublaslt_supported = mx_supported
"""The former name of :func:`mx_supported`."""


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
    here = capabilities.current()
    return {
        "emulate": "available",
        "ffi-cpu": extension.cpu_status(),
        "cublaslt": here.status("mx"),
        "cublaslt-block-fp8": here.status("block_fp8"),
        "cublaslt-fp4": here.status("fp4"),
        "native-recipes": _native_recipes(here),
    }


def _native_recipes(here: capabilities.Capabilities) -> str:
    native = [
        name
        for name, r in sorted(vars(recipes).items())
        if isinstance(r, Recipe) and "cuda" in kernels(_fwd_gemm(r), here)
    ]
    if not native:
        return "none (every recipe is emulated on this machine)"
    return ", ".join(native) + " (cuBLASLt)"


def _fwd_gemm(r: Recipe) -> Gemm:
    """A recipe's GEMMs as the dispatcher sees them (its two formats, as in the dgrad GEMM)."""
    return Gemm(
        formats=(r.fwd, r.grad),
        backend=r.backend,
        accumulation=r.accumulation,
        scale_mode=r.scale_mode,
    )
