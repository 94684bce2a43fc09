"""Training recipes: which MX format each GEMM operand gets, and how.

Example:
    >>> import jaxmx
    >>> jaxmx.recipes.MXFP8
    Recipe(fwd='mxfp8_e4m3', grad='mxfp8_e4m3', scale_mode='rceil', backend='auto', residuals='quantized', grad_rounding='nearest', accum_bits=None, promote_every=None, weight_tile=None, rht=False, rht_seed=0, wgrad='quantized', exact_emulation=False)
    >>> jaxmx.Recipe(grad="mxfp8_e5m2") == jaxmx.recipes.MXFP8_HYBRID
    True
    >>> sorted(n for n in jaxmx.recipes.__all__ if n.startswith("FP8"))
    ['FP8_BLOCK_POW2', 'FP8_ROWWISE', 'FP8_ROWWISE_GW_HP', 'FP8_TENSORWISE']
"""  # noqa: E501

from jaxmx._src.core.recipes import (
    DEEPSEEK_FP8,
    FP8_BLOCK_POW2,
    FP8_ROWWISE,
    FP8_ROWWISE_GW_HP,
    FP8_TENSORWISE,
    MXFP4,
    MXFP8,
    MXFP8_2D,
    MXFP8_HYBRID,
    NVFP4,
    Recipe,
)

__all__ = [
    "DEEPSEEK_FP8",
    "FP8_BLOCK_POW2",
    "FP8_ROWWISE",
    "FP8_ROWWISE_GW_HP",
    "FP8_TENSORWISE",
    "MXFP4",
    "MXFP8",
    "MXFP8_2D",
    "MXFP8_HYBRID",
    "NVFP4",
    "Recipe",
]
