"""The native GEMMs: XLA FFI custom calls into the ``jaxmx._ffi`` extension, one module per family.

Four custom-call targets, each with a CPU handler (plain C++, always built) and a cuBLASLt handler
(built with ``JAXMX_CUDA=ON``, see docs/native.md):

- ``jaxmx_mx_matmul`` (:mod:`.mx`): MXFP8 operands (E4M3 / E5M2 codes, one E8M0 scale per 32
  elements along K, scales in the cuBLAS 128x4 tiled layout); cuBLASLt ``VEC32_UE8M0`` block
  scaling, which needs compute capability >= 10.0 and CUDA >= 12.8.
- ``jaxmx_fp8_matmul`` (:mod:`.fp8`): FP8 operands with one float32 scale per tensor (cuBLASLt
  ``SCALAR_32F``, compute capability >= 8.9, so Hopper too); :mod:`.current_fp8` runs the
  per-tensor and per-row FP8 formats on it.
- ``jaxmx_block_fp8_matmul`` (:mod:`.block_fp8`): block-FP8 operands (``fp8_e4m3_block`` /
  ``fp8_e5m2_block``: one float32 scale per 1x128 block along K, or per 128x128 tile for one of
  the operands); cuBLASLt ``VEC128_32F`` / ``BLK128x128_32F`` scaling, compute capability 9.x and
  CUDA >= 12.9.
- ``jaxmx_fp4_matmul`` (:mod:`.fp4`): FP4 operands, both MXFP4 (E8M0 scales per 32) or both NVFP4
  (E4M3 scales per 16 and a float32 tensor scale each, applied as ``alpha``), E2M1 codes packed
  two per byte; cuBLASLt ``VEC32_UE8M0`` / ``VEC16_UE4M3`` scaling on ``CUDA_R_4F_E2M1``,
  compute capability >= 10.0 and CUDA >= 12.8.

All take TN operands, ``a`` [..., M, K] and ``b`` [..., N, K], and return ``a @ b^T`` [..., M, N]
in bfloat16, float16 or float32, accumulated in float32. The MX GEMM also takes K-first operands
([..., K, rows], quantized along K): untransposed where the default CUDA device has compute
capability 10.x (cuBLASLt's non-TN MXFP8 layouts), transposed to TN form everywhere else. All are
jitted (one compiled call per shape when called eagerly) and vmappable; the MX and block-FP8
GEMMs are partitioned under SPMD by :mod:`jaxmx._src.gemm.partitioning` (the per-tensor FP8 and
the FP4 GEMMs are not: XLA gathers their operands). :mod:`.operands` checks the operands of every
family; :mod:`.call` lowers the custom call per platform. Each family module defines its
:class:`~jaxmx._src.gemm.kernels.Kernel` (``MX_KERNEL``, ...), which the dispatcher chooses.
This ``__init__`` gathers the names the rest of the package uses (the one ``_src`` package that
re-exports).

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> from jaxmx import ffi
    >>> a = jaxmx.quantize(jnp.ones((4, 64)))
    >>> b = jaxmx.quantize(jnp.full((8, 64), 0.5))
    >>> ffi.mx_matmul(a, b, jnp.float32)[0, :3].tolist()
    [32.0, 32.0, 32.0]
"""

from jaxmx._src.gemm.native.block_fp8 import (
    BLOCK_FP8_FORMATS,
    BLOCK_FP8_KERNEL,
    BLOCK_FP8_TARGET,
    BLOCK_TILE,
    block_fp8_matmul,
)
from jaxmx._src.gemm.native.call import WORKSPACE_BYTES
from jaxmx._src.gemm.native.current_fp8 import (
    CURRENT_FP8_FORMATS,
    FP8_KERNEL,
    current_fp8_matmul,
    tn_codes,
)
from jaxmx._src.gemm.native.fp4 import FP4_FORMATS, FP4_KERNEL, FP4_TARGET, fp4_matmul, fp4_scales
from jaxmx._src.gemm.native.fp8 import FP8_TARGET, fp8_matmul
from jaxmx._src.gemm.native.mx import (
    MX_KERNEL,
    MX_POW2_TWIN_KERNEL,
    MX_TARGET,
    MXFP8_FORMATS,
    mx_matmul,
)
from jaxmx._src.gemm.native.operands import tn_form

__all__ = [
    "BLOCK_FP8_FORMATS",
    "BLOCK_FP8_KERNEL",
    "BLOCK_FP8_TARGET",
    "BLOCK_TILE",
    "CURRENT_FP8_FORMATS",
    "FP4_FORMATS",
    "FP4_KERNEL",
    "FP4_TARGET",
    "FP8_KERNEL",
    "FP8_TARGET",
    "MXFP8_FORMATS",
    "MX_KERNEL",
    "MX_POW2_TWIN_KERNEL",
    "MX_TARGET",
    "WORKSPACE_BYTES",
    "block_fp8_matmul",
    "current_fp8_matmul",
    "fp4_matmul",
    "fp4_scales",
    "fp8_matmul",
    "mx_matmul",
    "tn_codes",
    "tn_form",
]
