"""``flax.nnx`` layers whose matmuls run through :func:`jaxmx.dot_general`, and model conversion.

``Linear`` and ``Einsum`` take the arguments of ``nnx.Linear`` / ``nnx.Einsum`` plus ``recipe``;
:func:`quantize_model` converts an existing model's layers in place; :func:`init_kv_cache` gives
its ``nnx.MultiHeadAttention`` layers a ``jaxmx.KVCache`` to decode with; :func:`quantize_weights`
stores a trained model's GEMM weights as MXArrays for inference (in place);
:func:`load_checkpoint` and :func:`export_checkpoint` read and write a Hugging Face checkpoint
(:mod:`jaxmx.checkpoints`), as master weights or weights at rest.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jaxmx.flax.nnx as mxnnx
    >>> layer = mxnnx.Linear(32, 16, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((4, 32))).shape, layer.kernel.dtype
    ((4, 16), dtype('float32'))
"""

from jaxmx._src.flax.checkpoint_names import hf_name
from jaxmx._src.flax.checkpoint_tensors import CheckpointReport
from jaxmx._src.flax.conversion_report import ConversionReport, LayerPlan
from jaxmx._src.flax.nnx import Einsum, Linear
from jaxmx._src.flax.nnx_checkpoints import export_checkpoint, load_checkpoint
from jaxmx._src.flax.nnx_conversion import quantize_model
from jaxmx._src.flax.nnx_kv_cache import KVCacheAttention, init_kv_cache
from jaxmx._src.flax.nnx_weights import QuantizedLinear, quantize_weights
from jaxmx._src.flax.rules import DEFAULT_EXCLUDE

__all__ = [
    "DEFAULT_EXCLUDE",
    "CheckpointReport",
    "ConversionReport",
    "Einsum",
    "KVCacheAttention",
    "LayerPlan",
    "Linear",
    "QuantizedLinear",
    "export_checkpoint",
    "hf_name",
    "init_kv_cache",
    "load_checkpoint",
    "quantize_model",
    "quantize_weights",
]
