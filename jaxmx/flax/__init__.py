"""Flax layers that run their matmuls through jaxmx (``pip install -e ".[flax]"`` in a jaxmx clone).

``import jaxmx`` never imports Flax; this subpackage does. Two APIs, one per Flax flavour:

- :mod:`jaxmx.flax.linen`: ``Dense``, ``DenseGeneral``, ``Einsum``, ``dot_general(recipe)`` (for
  the ``dot_general`` argument of stock ``flax.linen`` layers), ``quantize_model`` (converts
  an existing model without editing it) and ``conversion_report`` (what it converts).
- :mod:`jaxmx.flax.nnx`: ``Linear``, ``Einsum`` and ``quantize_model`` (converts an existing
  model's ``Linear`` / ``LinearGeneral`` / ``Einsum`` layers in place and returns its report).

Both have ``quantize_weights``: a trained model's GEMM weights stored as MXArrays, for inference
(docs/serving.md).

Both Flax APIs take :class:`MXAttention` as the ``attention_fn`` of their attention layers, for
MX attention products, and a module of experts holds an :class:`MXRaggedDot` for its grouped
GEMMs.

Every layer takes ``recipe=`` (default :data:`jaxmx.recipes.MXFP8`); ``recipe=None`` runs the
plain high-precision ``lax.dot_general``, identical to the Flax layer. Parameters keep their
``param_dtype`` (fp32 / bf16 master weights); quantization happens inside the call.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx.flax.linen as mxl
    >>> layer = mxl.Dense(64)
    >>> params = layer.init(jax.random.key(0), jnp.ones((8, 32)))
    >>> params["params"]["kernel"].dtype, layer.apply(params, jnp.ones((8, 32))).shape
    (dtype('float32'), (8, 64))
"""

from jaxmx._src.flax.ops import MXAttention, MXDotGeneral, MXEinsum, MXRaggedDot
from jaxmx.flax import linen, nnx

__all__ = ["MXAttention", "MXDotGeneral", "MXEinsum", "MXRaggedDot", "linen", "nnx"]
