"""jaxmx: micro-scaled (MX) low-precision training for JAX.

The public API is this module's names plus :mod:`jaxmx.recipes`, :mod:`jaxmx.checkpoints`
(the peers' checkpoint formats), :mod:`jaxmx.ffi` (the native custom calls) and
:mod:`jaxmx.flax` (``jaxmx.flax.linen``, ``jaxmx.flax.nnx``). Everything under ``jaxmx._src`` is
implementation.

``import jaxmx`` loads no JAX: each public name loads the module that defines it on first use
(:pep:`562`), so that a program which only reads the format names (``python -m jaxmx.demo
--help``) answers at once. The ``TYPE_CHECKING`` imports below are the same names for type
checkers and readers; :data:`_SOURCES` maps each to its module.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.ones((2, 32)), "mxfp8_e4m3")
    >>> jaxmx.dequantize(q).sum().item()
    64.0
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jaxmx._version import __version__

if TYPE_CHECKING:
    from jaxmx import checkpoints, diagnostics, ffi, recipes
    from jaxmx._src.core.block_sharding import BlockShardingError
    from jaxmx._src.core.copies import Copies, SwizzledCopies
    from jaxmx._src.core.formats import FORMATS, SAVE_FORMATS, Format
    from jaxmx._src.core.mxarray import MXArray
    from jaxmx._src.core.recipes import BACKENDS, Recipe
    from jaxmx._src.core.scale_kinds import (
        BLOCK_SCALE_MODES,
        CURRENT_SCALE_MODES,
        NVFP4_SCALE_MODES,
        SCALE_MODES,
    )
    from jaxmx._src.core.swizzle import swizzle_scales, unswizzle_scales
    from jaxmx._src.gemm.availability import backends
    from jaxmx._src.gemm.matmul import matmul
    from jaxmx._src.quantize.fake import fake_quantize
    from jaxmx._src.quantize.hadamard import rht
    from jaxmx._src.quantize.quantize import dequantize, quantize, quantize_rowwise_colwise
    from jaxmx._src.quantize.requantize import requantize
    from jaxmx._src.serving.kv_cache import KVCache, cached_attention
    from jaxmx._src.serving.stored_weights import store_weight, weight_matmul
    from jaxmx._src.training.attention import dot_product_attention
    from jaxmx._src.training.contract import LHS_COLWISE, LHS_INPUT, RHS_COLWISE, RHS_INPUT
    from jaxmx._src.training.dot_general import dot_general
    from jaxmx._src.training.einsum import einsum
    from jaxmx._src.training.expert_parallel import expert_parallel_ffn
    from jaxmx._src.training.fsdp import fsdp_dot_general
    from jaxmx._src.training.grouped import grouped_recipe
    from jaxmx._src.training.ragged import ragged_dot
    from jaxmx._src.training.saved_activations import SAVED_QUANTIZED, save_quantized
    from jaxmx._src.training.scope import stochastic_rounding

_SUBMODULES = ("checkpoints", "diagnostics", "ffi", "recipes")
"""The public modules among this module's names (``jaxmx.recipes``, ...)."""

_SOURCES = {
    name: module
    for module, names in {
        "jaxmx._src.core.block_sharding": ("BlockShardingError",),
        "jaxmx._src.core.copies": ("Copies", "SwizzledCopies"),
        "jaxmx._src.core.formats": ("FORMATS", "SAVE_FORMATS", "Format"),
        "jaxmx._src.core.mxarray": ("MXArray",),
        "jaxmx._src.core.recipes": ("BACKENDS", "Recipe"),
        "jaxmx._src.core.scale_kinds": (
            "BLOCK_SCALE_MODES",
            "CURRENT_SCALE_MODES",
            "NVFP4_SCALE_MODES",
            "SCALE_MODES",
        ),
        "jaxmx._src.core.swizzle": ("swizzle_scales", "unswizzle_scales"),
        "jaxmx._src.gemm.availability": ("backends",),
        "jaxmx._src.gemm.matmul": ("matmul",),
        "jaxmx._src.quantize.fake": ("fake_quantize",),
        "jaxmx._src.quantize.hadamard": ("rht",),
        "jaxmx._src.quantize.quantize": ("dequantize", "quantize", "quantize_rowwise_colwise"),
        "jaxmx._src.quantize.requantize": ("requantize",),
        "jaxmx._src.serving.kv_cache": ("KVCache", "cached_attention"),
        "jaxmx._src.serving.stored_weights": ("store_weight", "weight_matmul"),
        "jaxmx._src.training.attention": ("dot_product_attention",),
        "jaxmx._src.training.contract": ("LHS_COLWISE", "LHS_INPUT", "RHS_COLWISE", "RHS_INPUT"),
        "jaxmx._src.training.dot_general": ("dot_general",),
        "jaxmx._src.training.einsum": ("einsum",),
        "jaxmx._src.training.expert_parallel": ("expert_parallel_ffn",),
        "jaxmx._src.training.fsdp": ("fsdp_dot_general",),
        "jaxmx._src.training.grouped": ("grouped_recipe",),
        "jaxmx._src.training.ragged": ("ragged_dot",),
        "jaxmx._src.training.saved_activations": ("SAVED_QUANTIZED", "save_quantized"),
        "jaxmx._src.training.scope": ("stochastic_rounding",),
    }.items()
    for name in names
}
"""The module that defines each of this module's other names (the ``TYPE_CHECKING`` imports)."""

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
    "store_weight",
    "swizzle_scales",
    "unswizzle_scales",
    "weight_matmul",
]


def __getattr__(name: str):
    """Loads a public name on first use: its module (:data:`_SUBMODULES`, :data:`_SOURCES`),
    kept in this module's namespace from then on."""
    if name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name in _SOURCES:
        value = getattr(importlib.import_module(_SOURCES[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
