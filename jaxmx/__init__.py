"""jaxmx: micro-scaled (MX) low-precision training for JAX.

The public API is this module's names plus :mod:`jaxmx.recipes`, :mod:`jaxmx.checkpoints`
(the peers' checkpoint formats), :mod:`jaxmx.ffi` (the native custom calls) and
:mod:`jaxmx.flax` (``jaxmx.flax.linen``, ``jaxmx.flax.nnx``). Everything under ``jaxmx._src`` is
implementation.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.ones((2, 32)), "mxfp8_e4m3")
    >>> jaxmx.dequantize(q).sum().item()
    64.0
"""

from jaxmx import checkpoints, diagnostics, ffi, recipes
from jaxmx._src.core.block_sharding import BlockShardingError
from jaxmx._src.core.copies import Copies, SwizzledCopies
from jaxmx._src.core.formats import (
    BLOCK_SCALE_MODES,
    CURRENT_SCALE_MODES,
    FORMATS,
    NVFP4_SCALE_MODES,
    SCALE_MODES,
    Format,
)
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.recipes import BACKENDS, Recipe
from jaxmx._src.core.swizzle import swizzle_scales, unswizzle_scales
from jaxmx._src.gemm.availability import backends
from jaxmx._src.gemm.matmul import matmul
from jaxmx._src.quantize.fake import fake_quantize
from jaxmx._src.quantize.hadamard import rht
from jaxmx._src.quantize.quantize import dequantize, quantize, quantize_rowwise_colwise
from jaxmx._src.quantize.requantize import requantize
from jaxmx._src.serving.kv_cache import KVCache, cached_attention
from jaxmx._src.training.attention import dot_product_attention
from jaxmx._src.training.dot_general import (
    LHS_COLWISE,
    LHS_INPUT,
    RHS_COLWISE,
    RHS_INPUT,
    dot_general,
)
from jaxmx._src.training.einsum import einsum
from jaxmx._src.training.expert_parallel import expert_parallel_ffn
from jaxmx._src.training.fsdp import fsdp_dot_general
from jaxmx._src.training.ragged import grouped_recipe, ragged_dot
from jaxmx._src.training.saved_activations import (
    SAVE_FORMATS,
    SAVED_QUANTIZED,
    save_quantized,
)
from jaxmx._src.training.scope import stochastic_rounding
from jaxmx._version import __version__

__all__ = [
    "BACKENDS",
    "BLOCK_SCALE_MODES",
    "CURRENT_SCALE_MODES",
    "FORMATS",
    "LHS_COLWISE",
    "LHS_INPUT",
    "NVFP4_SCALE_MODES",
    "RHS_COLWISE",
    "RHS_INPUT",
    "SAVED_QUANTIZED",
    "SAVE_FORMATS",
    "SCALE_MODES",
    "BlockShardingError",
    "Copies",
    "Format",
    "KVCache",
    "MXArray",
    "Recipe",
    "SwizzledCopies",
    "__version__",
    "backends",
    "cached_attention",
    "checkpoints",
    "dequantize",
    "diagnostics",
    "dot_general",
    "dot_product_attention",
    "einsum",
    "expert_parallel_ffn",
    "fake_quantize",
    "ffi",
    "fsdp_dot_general",
    "grouped_recipe",
    "matmul",
    "quantize",
    "quantize_rowwise_colwise",
    "ragged_dot",
    "recipes",
    "requantize",
    "rht",
    "save_quantized",
    "stochastic_rounding",
    "swizzle_scales",
    "unswizzle_scales",
]
