"""The native GEMMs as raw custom calls (XLA FFI), and what this machine can run.

``mx_matmul`` multiplies MXFP8 operands in TN form (cuBLASLt block scaling on Blackwell, a C++
handler on the CPU); ``fp8_matmul`` multiplies FP8 operands with per-tensor float32 scales
(cuBLASLt on compute capability >= 8.9, the C++ handler on the CPU). Most code calls
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

from jaxmx._src.backends import NATIVE_FORMATS, backends, cublaslt_supported
from jaxmx._src.extension import register_targets
from jaxmx._src.native import FP8_TARGET, MX_TARGET, WORKSPACE_BYTES, fp8_matmul, mx_matmul

__all__ = [
    "FP8_TARGET",
    "MX_TARGET",
    "NATIVE_FORMATS",
    "WORKSPACE_BYTES",
    "backends",
    "cublaslt_supported",
    "fp8_matmul",
    "mx_matmul",
    "register_targets",
]
