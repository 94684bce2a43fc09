"""Type stub of ``jaxmx._ffi``, the nanobind extension built from ffi/module.cc.

It holds the XLA FFI handlers of the native GEMMs (as capsules for
``jax.ffi.register_ffi_target``) and a few helpers for tests and diagnostics. The dict keys
below are the ones ffi/module.cc writes; tests/test_ffi.py checks that this stub and the
compiled module agree (names, and the keys of every dict returned at run time).

Example:
    >>> from jaxmx import _ffi
    >>> sorted(_ffi.registrations()["cpu"])[:2]
    ['jaxmx_block_fp8_matmul', 'jaxmx_fp4_matmul']
"""

from typing import TypedDict

import numpy as np
import numpy.typing as npt
from typing_extensions import CapsuleType, NotRequired

has_cuda: bool
"""Whether the extension was built with the cuBLASLt handlers (``JAXMX_CUDA=ON``)."""

class Targets(TypedDict):
    """The CPU handlers: one capsule per custom-call target."""

    jaxmx_mx_matmul: CapsuleType
    jaxmx_fp8_matmul: CapsuleType
    jaxmx_block_fp8_matmul: CapsuleType
    jaxmx_fp4_matmul: CapsuleType

class Stages(TypedDict):
    """A CUDA handler bundle: XLA runs ``initialize`` before each execution, outside graph
    capture, then ``execute``."""

    initialize: CapsuleType
    execute: CapsuleType

class CudaTargets(TypedDict):
    """The cuBLASLt handlers: one bundle per custom-call target."""

    jaxmx_mx_matmul: Stages
    jaxmx_fp8_matmul: Stages
    jaxmx_block_fp8_matmul: Stages
    jaxmx_fp4_matmul: Stages

class Registrations(TypedDict):
    """``{platform: {target: handler}}``, the platforms as ``jax.ffi.register_ffi_target``
    names them."""

    cpu: Targets
    CUDA: NotRequired[CudaTargets]  # a build with cuBLASLt only

class BuildInfo(TypedDict):
    """How the extension was built. The CUDA keys are present in a build with cuBLASLt only,
    ``compiler`` where it was built by gcc or clang."""

    has_cuda: bool
    cuda_include_dir: NotRequired[str]  # the cuBLASLt headers' directory
    cuda_include_dirs: NotRequired[str]  # every CUDA include directory, os.pathsep-separated
    cudart_header_version: NotRequired[int]  # CUDART_VERSION, e.g. 12080
    cublas_header_version: NotRequired[int]  # CUBLAS_VERSION, e.g. 120803
    compiler: NotRequired[str]  # e.g. "gcc 12.2.0"

class CudaLibraries(TypedDict):
    """libcudart / libcublasLt as loaded (dlopen) by the CUDA handler."""

    loaded: bool
    error: str  # why they did not load; "" when they did
    cudart: str  # the loaded file's path
    cublaslt: str
    cudart_version: int  # e.g. 12080
    cublaslt_version: int  # e.g. 120803

def registrations() -> Registrations:
    """``{platform: {target name: handler capsule, or {stage: capsule}}}`` for
    ``jax.ffi.register_ffi_target``."""

def build_info() -> BuildInfo:
    """How the extension was built (CUDA header versions, compiler)."""

def align_workspace(address: int, size: int) -> tuple[int, int]:
    """``(offset, usable bytes)`` of the 256-byte aligned cuBLASLt workspace the CUDA handler
    takes from an XLA buffer at ``address`` of ``size`` bytes."""

def unswizzle_scales(buf: npt.NDArray[np.uint8], rows: int, cols: int) -> npt.NDArray[np.uint8]:
    """Reads a swizzled (cuBLAS 128x4 tiled) 1-D uint8 scale buffer back to ``[rows, cols]``,
    with the C++ layout code the CPU GEMM handler uses. Raises ValueError on a size mismatch."""

def cuda_libraries() -> CudaLibraries:
    """Loads libcudart / libcublasLt (dlopen; no GPU needed) and reports paths and versions.
    Defined in a build with cuBLASLt only (``has_cuda``)."""
