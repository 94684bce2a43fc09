"""Machines the dispatcher tests lower for: :class:`Capabilities` values, as a probe of each
would report them."""

from jaxmx._src.gemm.capabilities import Capabilities

BLACKWELL = Capabilities(compute_capability=(10, 0), cublaslt_version=120800)
"""A data-centre Blackwell GPU (sm_100): the MX and FP4 GEMMs, non-TN MX layouts."""

BLACKWELL_12X = Capabilities(compute_capability=(12, 0), cublaslt_version=120800)
"""A GeForce / workstation Blackwell GPU (sm_120): the MX and FP4 GEMMs, TN layouts only."""

HOPPER = Capabilities(compute_capability=(9, 0), cublaslt_version=120900)
"""An H100 / H200 (sm_90): the block-FP8 and per-tensor FP8 GEMMs."""

NO_GPU = Capabilities(no_device="no CUDA GPU")
"""A host without a CUDA device."""
