"""Checkpoints in the formats open-weight models ship: Hugging Face style directories whose
quantized weights (transformers' fine-grained FP8, MXFP8 and gpt-oss MXFP4, compressed-tensors'
FP8 / MXFP8 / MXFP4 / NVFP4, NVIDIA ModelOpt's NVFP4) load as MXArrays with no decode and are
written back bit for bit (docs/checkpoints.md); and orbax checkpoints of trees of MXArrays that
keep each MXArray's format (:func:`save_orbax` / :func:`restore_orbax`, docs/serving.md).

Example:
    >>> import tempfile, jax.numpy as jnp, jaxmx
    >>> from jaxmx import checkpoints
    >>> w = jaxmx.quantize(jnp.ones((256, 256)), "fp8_e4m3_block", tile=(128, 128))
    >>> d = tempfile.mkdtemp()
    >>> checkpoints.save(d, {"proj.weight": w}, checkpoints.Scheme(method="fp8", weights="block"))
    >>> ckpt = checkpoints.load(d)
    >>> ckpt.scheme.method, ckpt.tensors["proj.weight"].scale.shape
    ('fp8', (2, 2))
"""

from jaxmx._src.checkpoints.directory import Checkpoint, load, save
from jaxmx._src.checkpoints.orbax_layout import (
    check_mx_layout,
    mx_layout,
    restore_orbax,
    save_orbax,
)
from jaxmx._src.checkpoints.safetensors_files import CheckpointError
from jaxmx._src.checkpoints.scheme import LAYOUTS, METHODS, SCALE_DTYPES, Scheme

__all__ = [
    "LAYOUTS",
    "METHODS",
    "SCALE_DTYPES",
    "Checkpoint",
    "CheckpointError",
    "Scheme",
    "check_mx_layout",
    "load",
    "mx_layout",
    "restore_orbax",
    "save",
    "save_orbax",
]
