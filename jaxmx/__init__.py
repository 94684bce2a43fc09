"""jaxmx: micro-scaled (MX) low-precision training for JAX.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.ones((2, 32)), "mxfp8_e4m3")
    >>> jaxmx.dequantize(q).sum().item()
    64.0
"""

from jaxmx.formats import FORMATS, SCALE_MODES, Format
from jaxmx.mxarray import MXArray
from jaxmx.quantize import dequantize, quantize, quantize_rowwise_colwise
from jaxmx.swizzle import swizzle_scales, unswizzle_scales

__all__ = [
    "FORMATS",
    "SCALE_MODES",
    "Format",
    "MXArray",
    "dequantize",
    "quantize",
    "quantize_rowwise_colwise",
    "swizzle_scales",
    "unswizzle_scales",
]
__version__ = "0.1.0"
