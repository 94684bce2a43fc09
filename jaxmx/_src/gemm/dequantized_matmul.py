"""The emulated GEMM for float32-scaled (block FP8) and tiled operands: dequantize, then a
float32 dot.

Block-FP8 values ``code * s`` with a float32 scale ``s`` are not exact in bfloat16, so unlike
the MX emulation (:mod:`jaxmx._src.gemm.emulate`) both operands are decoded to float32 and
multiplied at ``Precision.HIGHEST`` on every platform, with float32 accumulation: the result is
the float32 dot of the dequantized operands.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> a = jaxmx.quantize(jnp.ones((2, 128)), "fp8_e4m3_block")
    >>> b = jaxmx.quantize(jnp.full((3, 128), 0.5), "fp8_e4m3_block", tile=(128, 128))
    >>> dequantized_matmul(a, b, jnp.float32).tolist()
    [[64.0, 64.0, 64.0], [64.0, 64.0, 64.0]]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.gemm.kernels import Kernel
from jaxmx._src.quantize.quantize import dequantize


@functools.partial(jax.jit, static_argnums=2)
def dequantized_matmul(a: MXArray, b: MXArray, out_dtype) -> jax.Array:
    """``out[..., m, n] = sum_k a[..., m, k] * b[..., n, k]`` for checked operands in any layout
    :func:`jaxmx.matmul` takes, from their float32 dequantized values."""
    a_values, b_values = dequantize(a), dequantize(b)
    batch = tuple(range(a_values.ndim - 2))
    out = lax.dot_general(
        a_values,
        b_values,
        (((a.data_axis,), (b.data_axis,)), (batch, batch)),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return out.astype(out_dtype)


DEQUANTIZED = Kernel(
    name="dequantized",
    run=lambda a, b, out_dtype, _: dequantized_matmul(a, b, out_dtype),
    gathers_8bit=True,
)
"""Float32 dequantized operands: float32 scales, narrow tiles, unequal blocks, grouped GEMMs."""
