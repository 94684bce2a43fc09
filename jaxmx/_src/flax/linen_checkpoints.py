"""Hugging Face checkpoints into and out of ``flax.linen`` parameter trees:
:func:`load_checkpoint` (a new tree) and :func:`export_checkpoint`.

Every leaf of the ``params`` tree is matched to a tensor of a
:class:`jaxmx.checkpoints.Checkpoint` by name (:func:`~jaxmx._src.flax.checkpoint_names.hf_name`:
``layers_0`` is ``layers.0``; or the user's map); the conversions of each tensor are
:mod:`jaxmx._src.flax.checkpoint_tensors`'.

Example:
    >>> import tempfile, jax, jax.numpy as jnp, flax.linen as nn, jaxmx
    >>> from jaxmx import checkpoints
    >>> w = jaxmx.quantize(jnp.ones((32, 64)), "mxfp8_e4m3")
    >>> d = tempfile.mkdtemp()
    >>> checkpoints.save(d, {"up_proj.weight": w, "up_proj.bias": jnp.zeros(32)},
    ...                  checkpoints.Scheme(method="mxfp8", weights="mxfp8"))
    >>> params = {"up_proj": nn.Dense(32).init(jax.random.key(0), jnp.ones((1, 64)))["params"]}
    >>> params, report = load_checkpoint(params, checkpoints.load(d))
    >>> print(report)
    up_proj/kernel  up_proj.weight  dequantized  mxfp8_e4m3
    up_proj/bias    up_proj.bias    copied       float32
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from flax import traverse_util
from flax.core import FrozenDict, freeze

from jaxmx._src.checkpoints.directory import Checkpoint
from jaxmx._src.checkpoints.scheme import Scheme
from jaxmx._src.flax.checkpoint_names import NameMap, hf_name, path_string, tensor_names
from jaxmx._src.flax.checkpoint_tensors import (
    DEFAULT_EXPORT_EXCLUDE,
    CheckpointReport,
    Exclude,
    Loaded,
    check_loadable,
    loaded_value,
    stored_label,
    tensor_of,
    unused_tensors,
    write_checkpoint,
)


def load_checkpoint(
    params, checkpoint: Checkpoint, *, names: NameMap = hf_name
) -> tuple[dict, CheckpointReport]:
    """A new ``params`` tree with every leaf set from its tensor in ``checkpoint``:
    ``(params, report)``.

    A quantized tensor (an MXArray) is decoded with :func:`jaxmx.dequantize` to the leaf's
    dtype, any other tensor cast to it; a kernel takes the transpose of its ``[out, in]``
    tensor (master weights, to fine-tune or run in high precision).

    Weights at rest: pass the params of :func:`jaxmx.flax.linen.quantize_weights` (run with the
    checkpoint's format and tiles, e.g. ``ckpt.tensors[name].fmt`` / ``.tile``): a kernel it
    stores as an MXArray takes the checkpoint's MXArray as it is (no decode), if it has the same
    format, tiles and shape; the module ``quantize_weights`` returned computes from it.

    Args:
        params: the model's parameters (``variables["params"]``); leaves may be
            ``jax.ShapeDtypeStruct`` (from ``jax.eval_shape`` of ``init``).
        checkpoint: from :func:`jaxmx.checkpoints.load`.
        names: the tensor name of each leaf: :func:`~jaxmx.flax.linen.hf_name` (default), a
            function ``path -> (tensor name, transposed)``, or a dict ``{"a/layers_0/kernel":
            "a.layers.0.weight"}`` whose entries replace ``hf_name``'s.

    Returns:
        ``(params, report)``: the new tree (a ``FrozenDict`` if ``params`` was one) and a
        :class:`CheckpointReport` (how each leaf was loaded; the checkpoint's tensors that no
        leaf took, with a warning naming those that are not activation scales).

    Raises:
        CheckpointError: naming the parameter and the tensor: a leaf with no tensor, or a
        tensor of another shape (or, for a weight at rest, format).
    """
    caller = "load_checkpoint"
    flat = _flat(params, caller)
    mapping = tensor_names(flat, names, caller)
    tensors = {}
    for path, current in flat.items():  # every name and shape first
        name, transposed = mapping[path]
        tensors[path] = tensor_of(checkpoint, path, name, caller)
        check_loadable(path, name, transposed, tensors[path], current, caller)
    out, loaded = {}, {}
    for path, current in flat.items():
        name, transposed = mapping[path]
        out[path], how = loaded_value(path, name, transposed, tensors[path], current, caller)
        loaded[path_string(path)] = Loaded(tensor=name, how=how, stored=stored_label(tensors[path]))
    unused = unused_tensors(checkpoint, (x.tensor for x in loaded.values()), caller)
    tree = traverse_util.unflatten_dict(out)
    return (freeze(tree) if isinstance(params, FrozenDict) else tree), CheckpointReport(
        loaded=loaded, unused=unused
    )


def export_checkpoint(
    params,
    path: str | os.PathLike,
    *,
    like: Checkpoint | None = None,
    scheme: Scheme | None = None,
    names: NameMap = hf_name,
    config=None,
    exclude: Exclude = DEFAULT_EXPORT_EXCLUDE,
    dtype=None,
) -> None:
    """Writes the ``params`` tree as a Hugging Face checkpoint directory (with
    :func:`jaxmx.checkpoints.save`), each leaf under its tensor name: as
    :func:`jaxmx.flax.nnx.export_checkpoint` does for an nnx model (``like``'s quantized
    kernels requantized against their scales, other kernels quantized afresh in ``scheme``
    unless ``exclude`` names them, MXArray leaves of ``quantize_weights`` written as they are).

    Args:
        params: the model's parameters (``variables["params"]``).
        path, like, scheme, names, config, exclude, dtype: as for
            :func:`jaxmx.flax.nnx.export_checkpoint`.
    """
    write_checkpoint(
        _flat(params, "export_checkpoint").items(),
        path,
        like=like,
        scheme=scheme,
        names=names,
        config=config,
        exclude=exclude,
        dtype=dtype,
    )


def _flat(params, caller: str) -> dict:
    if not isinstance(params, Mapping):
        raise TypeError(f"{caller}: params must be a dict of parameters, got {type(params)}")
    if set(params) == {"params"}:
        raise TypeError(f"{caller}: pass variables['params'] (the parameters), not the variables")
    return traverse_util.flatten_dict(params)
