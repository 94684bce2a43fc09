"""jaxmx: micro-scaled (MX) low-precision training for JAX.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.ones((2, 32)), "mxfp8_e4m3")
    >>> jaxmx.dequantize(q).sum().item()
    64.0
"""

from jaxmx import recipes
from jaxmx.dot_general import dot_general
from jaxmx.einsum import einsum
from jaxmx.ffi import backends
from jaxmx.formats import FORMATS, SCALE_MODES, Format
from jaxmx.keys import stochastic_rounding
from jaxmx.matmul import matmul
from jaxmx.mxarray import MXArray
from jaxmx.quantize import dequantize, quantize, quantize_rowwise_colwise
from jaxmx.recipes import Recipe
from jaxmx.swizzle import swizzle_scales, unswizzle_scales

__all__ = [
    "FORMATS",
    "SCALE_MODES",
    "Format",
    "MXArray",
    "Recipe",
    "backends",
    "dequantize",
    "dot_general",
    "einsum",
    "matmul",
    "quantize",
    "quantize_rowwise_colwise",
    "recipes",
    "stochastic_rounding",
    "swizzle_scales",
    "unswizzle_scales",
]
__version__ = "0.1.0"
