"""``flax.linen`` layers whose matmuls run through :func:`jaxmx.dot_general`.

``Dense``, ``DenseGeneral`` and ``Einsum`` take exactly the arguments of their Flax namesakes plus
``recipe`` (default :data:`jaxmx.recipes.MXFP8`; ``None`` = plain high precision), with the same
parameters, so checkpoints interchange with the stock layers. :func:`dot_general` gives the
``dot_general=`` argument of a stock layer; :func:`quantize_model` converts a whole model's
``Dense`` / ``DenseGeneral`` / ``Einsum`` layers without editing its source; within
:func:`kv_cache`, ``MultiHeadDotProductAttention(decode=True)`` decodes over a ``jaxmx.KVCache``;
:func:`quantize_weights` stores a trained model's GEMM weights as MXArrays for inference;
:func:`load_checkpoint` and :func:`export_checkpoint` read and write a Hugging Face checkpoint
(:mod:`jaxmx.checkpoints`) as a params tree.

Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmx.flax.linen as mxl
    >>> layer = nn.Dense(16, dot_general=mxl.dot_general())   # recipe defaults to MXFP8
    >>> y, _ = layer.init_with_output(jax.random.key(0), jnp.ones((4, 32)))
    >>> y.shape
    (4, 16)
"""

from jaxmx._src.flax.checkpoint_names import hf_name
from jaxmx._src.flax.checkpoint_tensors import CheckpointReport
from jaxmx._src.flax.conversion_report import ConversionReport, LayerPlan
from jaxmx._src.flax.linen import Dense, DenseGeneral, Einsum, dot_general
from jaxmx._src.flax.linen_checkpoints import export_checkpoint, load_checkpoint
from jaxmx._src.flax.linen_conversion import conversion_report, quantize_model
from jaxmx._src.flax.linen_kv_cache import kv_cache
from jaxmx._src.flax.linen_weights import quantize_weights, weights_report
from jaxmx._src.flax.rules import DEFAULT_EXCLUDE

__all__ = [
    "DEFAULT_EXCLUDE",
    "CheckpointReport",
    "ConversionReport",
    "Dense",
    "DenseGeneral",
    "Einsum",
    "LayerPlan",
    "conversion_report",
    "dot_general",
    "export_checkpoint",
    "hf_name",
    "kv_cache",
    "load_checkpoint",
    "quantize_model",
    "quantize_weights",
    "weights_report",
]
