"""The native GEMMs as raw custom calls (XLA FFI), and what this machine can run.

``mx_matmul`` multiplies MXFP8 operands in TN form or K-first (cuBLASLt block scaling on
Blackwell, a C++ handler on the CPU); ``block_fp8_matmul`` block-FP8 operands (1x128 blocks or
128x128 tiles, float32 scales: cuBLASLt on Hopper, the C++ handler on the CPU); ``fp4_matmul``
NVFP4 or MXFP4 operands (cuBLASLt on Blackwell, the C++ handler on the CPU); ``fp8_matmul`` FP8
operands with per-tensor float32 scales (cuBLASLt on compute capability >= 8.9, the C++ handler
on the CPU), also the GEMM of the per-tensor and per-row FP8 formats (``CURRENT_FP8_FORMATS``).
Most code calls
:func:`jaxmx.matmul` or :func:`jaxmx.dot_general` with ``backend="ffi"`` instead.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> from jaxmx import ffi
    >>> a = jaxmx.quantize(jnp.ones((4, 64)))
    >>> ffi.mx_matmul(a, a, jnp.float32)[0, 0].item()
    64.0
    >>> ffi.backends()["ffi-cpu"]
    'available'
"""

from jaxmx._src.gemm.availability import (
    NATIVE_FORMATS,
    backends,
    block_fp8_supported,
    cublaslt_supported,
    fp4_supported,
    fp8_supported,
    mx_supported,
)
from jaxmx._src.gemm.extension import build_info, register_targets
from jaxmx._src.gemm.native import (
    BLOCK_FP8_FORMATS,
    BLOCK_FP8_TARGET,
    CURRENT_FP8_FORMATS,
    FP4_FORMATS,
    FP4_TARGET,
    FP8_TARGET,
    MX_TARGET,
    MXFP8_FORMATS,
    WORKSPACE_BYTES,
    block_fp8_matmul,
    fp4_matmul,
    fp8_matmul,
    mx_matmul,
)

__all__ = [
    "BLOCK_FP8_FORMATS",
    "BLOCK_FP8_TARGET",
    "CURRENT_FP8_FORMATS",
    "FP4_FORMATS",
    "FP4_TARGET",
    "FP8_TARGET",
    "MXFP8_FORMATS",
    "MX_TARGET",
    "NATIVE_FORMATS",
    "WORKSPACE_BYTES",
    "backends",
    "block_fp8_matmul",
    "block_fp8_supported",
    "build_info",
    "cublaslt_supported",
    "fp4_matmul",
    "fp4_supported",
    "fp8_matmul",
    "fp8_supported",
    "mx_matmul",
    "mx_supported",
    "register_targets",
]
