"""Hugging Face checkpoints into and out of ``flax.nnx`` models: :func:`load_checkpoint` (in
place: master weights to fine-tune, or weights at rest to serve) and :func:`export_checkpoint`.

Every ``nnx.Param`` of the model is matched to a tensor of a :class:`jaxmx.checkpoints.Checkpoint`
by name (:func:`~jaxmx._src.flax.checkpoint_names.hf_name`, or the user's map); the conversions
of each tensor are :mod:`jaxmx._src.flax.checkpoint_tensors`'.

Example:
    >>> import tempfile, jax.numpy as jnp, jaxmx
    >>> from flax import nnx
    >>> from jaxmx import checkpoints
    >>> class Net(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.up_proj = nnx.Linear(64, 32, use_bias=False, rngs=rngs)
    >>> w = jaxmx.quantize(jnp.ones((32, 64)), "mxfp8_e4m3")
    >>> d = tempfile.mkdtemp()
    >>> checkpoints.save(d, {"up_proj.weight": w}, checkpoints.Scheme(method="mxfp8",
    ...                                                               weights="mxfp8"))
    >>> net = Net(nnx.Rngs(0))
    >>> print(load_checkpoint(net, checkpoints.load(d)))
    up_proj/kernel  up_proj.weight  dequantized  mxfp8_e4m3
    >>> net.up_proj.kernel.get_value().shape
    (64, 32)
"""

from __future__ import annotations

import os

from flax import nnx

from jaxmx._src.checkpoints.directory import Checkpoint
from jaxmx._src.checkpoints.scheme import Scheme
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.flax.checkpoint_names import NameMap, Path, hf_name, path_string, tensor_names
from jaxmx._src.flax.checkpoint_tensors import (
    DEFAULT_EXPORT_EXCLUDE,
    CheckpointReport,
    Exclude,
    Loaded,
    check_loadable,
    loaded_value,
    param_shape,
    stored_label,
    tensor_of,
    unused_tensors,
    write_checkpoint,
)
from jaxmx._src.flax.nnx_weights import QuantizedLinear, replace_module
from jaxmx._src.flax.weights import WeightStorage, hook_refusal


def load_checkpoint(
    model: nnx.Module,
    checkpoint: Checkpoint,
    *,
    names: NameMap = hf_name,
    at_rest: bool = False,
) -> CheckpointReport:
    """Sets every ``nnx.Param`` of ``model`` from its tensor in ``checkpoint``, in place.

    With ``at_rest=False`` (master weights, to fine-tune or to run in high precision), a
    quantized tensor (an MXArray) is decoded with :func:`jaxmx.dequantize` to the parameter's
    dtype, any other tensor cast to it; a kernel takes the transpose of its ``[out, in]``
    tensor. With ``at_rest=True`` (to serve), each ``nnx.Linear`` / ``nnx.LinearGeneral``
    whose weight is an MXArray ``[out, in]`` is replaced in its parent by a
    :class:`QuantizedLinear` holding that MXArray as it is (no decode; weight-only: the
    weight is decoded to the activation dtype inside its GEMM, as
    :func:`jaxmx.flax.nnx.quantize_weights` does), keeping the layer's bias; the other
    parameters load as master weights. A layer that already holds a weight at rest (a
    ``QuantizedLinear``) takes the checkpoint's MXArray as it is in either mode, if it has the
    same format, tiles and shape.

    Every parameter is checked to have its tensor, of its shape, before any is set. A
    parameter whose value is a ``jax.ShapeDtypeStruct`` (a model made under
    ``nnx.eval_shape``) gets its array; a sharded parameter keeps its sharding.

    Args:
        model: the nnx model (its attribute names mirroring the checkpoint's module names, for
            the default ``names``).
        checkpoint: from :func:`jaxmx.checkpoints.load`.
        names: the tensor name of each parameter: :func:`~jaxmx.flax.nnx.hf_name` (default), a
            function ``path -> (tensor name, transposed)``, or a dict ``{"a/b/0/kernel":
            "a.b.0.weight"}`` whose entries replace ``hf_name``'s.
        at_rest: as above.

    Returns:
        A :class:`CheckpointReport`: how each parameter was loaded, and the checkpoint's
        tensors that no parameter took (a warning names those that are not activation scales,
        which jaxmx does not need).

    Raises:
        CheckpointError: naming the parameter and the tensor: a parameter with no tensor, or a
        tensor of another shape (or, for a weight at rest, format).
    """
    caller = "load_checkpoint"
    params = [(p, v) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
    mapping = tensor_names([p for p, _ in params], names, caller)
    rest = _at_rest_layers(model) if at_rest else {}
    plan = []
    for path, param in params:  # every name and shape first: a failed load changes nothing
        name, transposed = mapping[path]
        tensor = tensor_of(checkpoint, path, name, caller)
        layer = rest.get(path[:-1]) if path[-1] == "kernel" else None
        if layer is not None and not _fits_at_rest(tensor, layer):
            layer = None
        if layer is None:
            check_loadable(path, name, transposed, tensor, param.get_value(), caller)
        plan.append((path, param, name, transposed, tensor, layer))
    loaded = {}
    for path, param, name, transposed, tensor, layer in plan:
        if layer is not None:
            how = "at rest"
            replace_module(model, path[:-1], _quantized(layer, tensor))
        else:
            value, how = loaded_value(path, name, transposed, tensor, param.get_value(), caller)
            param.set_value(value)
        loaded[path_string(path)] = Loaded(tensor=name, how=how, stored=stored_label(tensor))
    unused = unused_tensors(checkpoint, (x.tensor for x in loaded.values()), caller)
    return CheckpointReport(loaded=loaded, unused=unused)


def export_checkpoint(
    model: nnx.Module,
    path: str | os.PathLike,
    *,
    like: Checkpoint | None = None,
    scheme: Scheme | None = None,
    names: NameMap = hf_name,
    config=None,
    exclude: Exclude = DEFAULT_EXPORT_EXCLUDE,
    dtype=None,
) -> None:
    """Writes ``model``'s parameters as a Hugging Face checkpoint directory (with
    :func:`jaxmx.checkpoints.save`), each under its tensor name.

    Against ``like`` (the checkpoint the model was loaded from), each kernel whose tensor is an
    MXArray there is quantized with that MXArray's scales (:func:`jaxmx.requantize` of its
    ``[out, in]`` transpose): a weight that did not change since the load gives back its
    original bytes, and a block whose new values outgrew its scale gets a fresh one. The other
    parameters are written in their ``like`` tensor's dtype; ``like``'s activation scales
    (:data:`~jaxmx._src.flax.checkpoint_tensors.ACTIVATION_SCALES`, calibrated for its weights)
    are written back unchanged, and its other tensors that no parameter maps to are left out.

    A kernel with no quantized tensor in ``like`` to follow (no ``like``, a new layer, or a
    ``scheme`` other than ``like``'s) is quantized afresh in ``scheme``'s layout (block FP8 in
    ``scheme.block_size`` tiles, per tensor, per channel, MXFP8, MXFP4, NVFP4) unless
    ``exclude`` names its module; a weight at rest (a ``QuantizedLinear``'s MXArray) is written
    as it is.

    Args:
        model: the nnx model.
        path: the directory to write (created if needed).
        like: the checkpoint whose quantization to follow, e.g. the one the model was loaded
            from.
        scheme: the checkpoint's :class:`~jaxmx.checkpoints.Scheme`; default ``like.scheme``
            (``None`` without ``like``: nothing is quantized).
        names: as for :func:`load_checkpoint`.
        config: the ``config.json`` to write; default ``like.config``.
        exclude: the kernels not to quantize afresh: Hugging Face module names or patterns
            (``"lm_head"``, ``"*.mlp.gate"``; a pattern matches the name or a run of its dotted
            components) or a predicate ``module name -> bool``; default
            :data:`~jaxmx._src.flax.checkpoint_tensors.DEFAULT_EXPORT_EXCLUDE`.
        dtype: the dtype of the unquantized tensors; default ``like``'s tensor's, else the
            parameter's.

    Raises:
        CheckpointError: naming the parameter or tensor: two parameters with one tensor name, a
        parameter whose shape is not its ``like`` tensor's, a weight the scheme cannot store.
    """
    params = [(p, v.get_value()) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
    write_checkpoint(
        params,
        path,
        like=like,
        scheme=scheme,
        names=names,
        config=config,
        exclude=exclude,
        dtype=dtype,
    )


def _at_rest_layers(model: nnx.Module) -> dict[Path, nnx.Module]:
    """``{path: layer}`` of the Linear / LinearGeneral layers a weight at rest can replace."""
    return {
        path: module
        for path, module in nnx.iter_modules(model)
        if path and isinstance(module, (nnx.Linear, nnx.LinearGeneral)) and _plain(module)
    }


def _plain(module) -> bool:
    """A layer whose forward is its class's stock one, with Flax's GEMM (what
    ``QuantizedLinear`` computes)."""
    base = nnx.Linear if isinstance(module, nnx.Linear) else nnx.LinearGeneral
    if type(module).__call__ is not base.__call__ or hook_refusal(module) is not None:
        return False
    return not (isinstance(module, nnx.LinearGeneral) and module.batch_axis)


def _axes_and_features(layer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if isinstance(layer, nnx.Linear):
        return (-1,), (layer.out_features,)
    return tuple(layer.axis), tuple(layer.out_features)


def _fits_at_rest(tensor, layer) -> bool:
    """Whether ``tensor`` is an ``[N, K]`` MXArray blocked along K for ``layer``."""
    if not isinstance(tensor, MXArray) or tensor.ndim != 2 or tensor.axis != 1:
        return False
    kernel = layer.kernel.get_value()
    return param_shape(tensor.shape, tuple(kernel.shape), True) is not None


def _quantized(layer, tensor: MXArray) -> QuantizedLinear:
    axes, features = _axes_and_features(layer)
    return QuantizedLinear(
        tensor,
        layer.bias,
        axes=axes,
        features=features,
        dtype=layer.dtype,
        storage=WeightStorage(fmt=tensor.fmt, tile=tensor.tile),
    )
