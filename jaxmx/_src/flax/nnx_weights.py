"""Weights at rest for ``flax.nnx`` models, in place: :func:`quantize_weights`.

The model's layers are found by ``nnx.iter_modules`` and planned by
:meth:`~jaxmx._src.flax.rules.Conversion.plan` (the rules of ``quantize_model``); each converted
``nnx.Linear`` / ``nnx.LinearGeneral`` is replaced, in its parent, by a
:class:`QuantizedLinear` whose ``kernel`` Param holds the layer's weight as an
:class:`~jaxmx.MXArray` (:mod:`jaxmx._src.flax.weights`) and computes through
:func:`jaxmx.weight_matmul`.
"""

from __future__ import annotations

import dataclasses
import math

from flax import nnx

from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.flax.conversion_report import ConversionReport, LayerPlan
from jaxmx._src.flax.rules import (
    EMBEDDING,
    GEMM,
    REFUSED,
    Layer,
    Rule,
)
from jaxmx._src.flax.weights import (
    WeightStorage,
    dense_forward,
    hook_refusal,
    kernel_sizes,
    stored_weight,
    weights_conversion,
)

_EINSUM_NOTE = (
    "not converted: Einsum's contracting axes are set by its equation; weights at rest take "
    "Linear / LinearGeneral"
)


class QuantizedLinear(nnx.Module):
    """The forward pass of a converted ``nnx.Linear`` / ``nnx.LinearGeneral`` on its stored
    weight: ``kernel`` is a Param holding the ``[N, K]`` MXArray, ``bias`` the layer's bias
    Param (or ``None``); the result is in the layer's ``dtype``, else the input's.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxmx._src.flax.weights import WeightStorage
        >>> layer = QuantizedLinear.of(nnx.Linear(64, 8, rngs=nnx.Rngs(0)),
        ...                            WeightStorage(fmt="mxfp4"))
        >>> layer.kernel.get_value().fmt, layer(jnp.ones((2, 64), jnp.bfloat16)).dtype
        ('mxfp4', dtype(bfloat16))
    """

    def __init__(self, kernel: MXArray, bias, *, axes, features, dtype, storage: WeightStorage):
        self.kernel = nnx.Param(kernel)
        self.bias = bias
        self.axes, self.features, self.dtype, self.storage = axes, features, dtype, storage

    @classmethod
    def of(
        cls, layer: nnx.Linear | nnx.LinearGeneral, storage: WeightStorage, path: str = ""
    ) -> QuantizedLinear:
        """``layer`` (at ``path``) with its kernel stored as ``storage`` says (its bias Param
        kept)."""
        axes, features = _axes_and_features(layer)
        kernel = layer.kernel.get_value()
        return cls(
            stored_weight(kernel, axes, features, storage, path),
            layer.bias,
            axes=axes,
            features=features,
            dtype=layer.dtype,
            storage=storage,
        )

    def __call__(self, x):
        bias = None if self.bias is None else self.bias.get_value()
        dtype = x.dtype if self.dtype is None else self.dtype
        return dense_forward(
            x,
            self.kernel.get_value(),
            bias,
            axes=self.axes,
            features=self.features,
            storage=self.storage,
            dtype=dtype,
        )


def quantize_weights(
    model: nnx.Module,
    fmt: str,
    *,
    tile: tuple[int, int] | None = None,
    activations: bool = False,
    include: Rule = None,
    exclude: Rule = (),
    exclude_defaults: bool = True,
) -> ConversionReport:
    """Stores the GEMM weights of a trained ``model`` as :class:`jaxmx.MXArray`\\ s, in place,
    for inference, and reports each layer with its bytes.

    Each converted ``nnx.Linear`` / ``nnx.LinearGeneral`` is replaced in its parent by a
    :class:`QuantizedLinear` whose ``kernel`` Param holds ``jaxmx.quantize(kernel.reshape(K,
    N).T, fmt, axis=-1, tile=tile)`` (quantized along K, the contracted dims) and which keeps the
    layer's bias. The layers are chosen as by :func:`jaxmx.flax.nnx.quantize_model` (same
    ``include`` / ``exclude`` patterns and default exclusions: embeddings, output heads,
    routers). ``nnx.Embed`` tables stay as they are and ``nnx.Einsum`` layers are not converted;
    the report lists both, with why.

    Args:
        model: an nnx module holding the layers (not itself a layer).
        fmt: a format of :data:`jaxmx.FORMATS`: ``"mxfp8_e4m3"``, ``"mxfp4"``, ``"nvfp4"``,
            ``"fp8_e4m3_block"``, ...
        tile: ``None`` (1-D blocks along K) or ``(rows, cols)`` tiles of the ``[N, K]`` weight
            (NVFP4 ``(16, 16)``, block FP8 ``(128, 128)``).
        activations: ``False`` (default): weight-only (W8A16 / W4A16: the weight decoded to the
            activation dtype inside the GEMM, float32 accumulation); ``True``: the activations
            are quantized along K too and the GEMM is :func:`jaxmx.matmul` (W8A8 / W4A4).
        include, exclude, exclude_defaults: as for :func:`jaxmx.flax.nnx.quantize_model`.

    Returns:
        ``{path: LayerPlan}`` for every Linear / LinearGeneral / Einsum / Embed layer, with its
        stored format (``plan.weights``), ``plan.nbytes`` (its kernel as stored) and
        ``plan.bf16_nbytes``; ``report.nbytes`` and ``report.bf16_nbytes`` are the totals and
        ``print(report)`` shows the table.

    Raises:
        ValueError: an ``include`` pattern matches no convertible layer; nothing to convert;
            ``model`` is itself a Linear layer; a bad ``tile``.
        TypeError: the model is then differentiated (it is forward only).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jaxmx.flax.nnx as mxnnx
        >>> class Net(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.up = nnx.Linear(64, 32, rngs=rngs)
        ...         self.head = nnx.Linear(32, 10, rngs=rngs)
        ...     def __call__(self, x):
        ...         return self.head(self.up(x))
        >>> net = Net(nnx.Rngs(0))
        >>> report = mxnnx.quantize_weights(net, "mxfp8_e4m3")
        >>> print(report)
        head   Linear  high precision            1,280 B (2.00x bf16)  excluded by default: 'head'
        up     Linear  mxfp8_e4m3, weights only  2,112 B (0.52x bf16)  converted
        total                                    3,392 B (0.72x bf16)
        >>> net(jnp.ones((2, 64), jnp.bfloat16)).shape
        (2, 10)
    """
    storage = WeightStorage(fmt=fmt, tile=tile, activations=activations)
    conversion = weights_conversion(
        include=include, exclude=exclude, exclude_defaults=exclude_defaults
    )
    found = [
        (path, module, _layer("/".join(str(p) for p in path), module))
        for path, module in nnx.iter_modules(model)
    ]
    found = [(path, module, layer) for path, module, layer in found if layer is not None]
    report = conversion.plan([layer for *_, layer in found], in_call_order=False)
    if not report.converted:
        raise ValueError(f"quantize_weights: no layer of the model to convert:\n{report}")
    if report.get("") is not None and report[""].converted:
        raise ValueError(
            "quantize_weights: the model is itself a Linear layer; pass a module that holds it "
            "(its layer is replaced in its parent)"
        )
    plans, replaced = [], {}
    for path, module, _ in found:
        plan = report["/".join(str(p) for p in path)]
        layer, stored = module, None
        if plan.converted:
            layer = QuantizedLinear.of(module, storage, plan.path)
            replace_module(model, path, layer)
            replaced[id(module)] = (module, layer)
            stored = layer.kernel.get_value()
        plans.append(_sized(plan, module, layer, stored, storage))
    _replace_shared(model, replaced)
    return ConversionReport(plans)


def _replace_shared(model: nnx.Module, replaced: dict) -> None:
    """Replaces the other references to a converted layer held under several paths (``nnx``
    lists a shared module once, at its first path) by the same converted layer."""
    while again := [
        (path, replaced[id(m)][1])
        for path, m in nnx.iter_modules(model)
        if id(m) in replaced and replaced[id(m)][0] is m
    ]:
        for path, layer in again:
            replace_module(model, path, layer)


def _layer(path: str, module: nnx.Module) -> Layer | None:
    kind = type(module).__name__
    if isinstance(module, nnx.Embed):
        return Layer(
            path=path, kind=kind, role=EMBEDDING, vocab=module.num_embeddings, module=module
        )
    if isinstance(module, nnx.Einsum):
        return Layer(path=path, kind=kind, role=REFUSED, note=_EINSUM_NOTE, module=module)
    if not isinstance(module, (nnx.Linear, nnx.LinearGeneral)):
        return None
    note = _refusal(module)
    if note is not None:
        return Layer(path=path, kind=kind, role=REFUSED, note=note, module=module)
    _, features = _axes_and_features(module)
    return Layer(path=path, kind=kind, role=GEMM, out_width=math.prod(features), module=module)


def _refusal(module: nnx.Module) -> str | None:
    base = nnx.Linear if isinstance(module, nnx.Linear) else nnx.LinearGeneral
    if type(module).__call__ is not base.__call__:
        return f"not converted: {type(module).__name__} overrides {base.__name__}.__call__"
    if isinstance(module, nnx.LinearGeneral) and module.batch_axis:
        return "not converted: LinearGeneral with batch_axis"
    return hook_refusal(module)


def _axes_and_features(layer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if isinstance(layer, nnx.Linear):
        return (-1,), (layer.out_features,)
    return tuple(layer.axis), tuple(layer.out_features)


def replace_module(model: nnx.Module, path: tuple, new: nnx.Module) -> None:
    """Puts ``new`` in ``model`` at ``path`` (attribute names and list indices), in place of
    the module there."""
    parent = model
    for part in path[:-1]:
        parent = parent[part] if isinstance(part, int) else getattr(parent, part)
    if isinstance(path[-1], int):
        parent[path[-1]] = new
    else:
        setattr(parent, path[-1], new)


def _sized(plan: LayerPlan, module, layer, stored: MXArray | None, storage: WeightStorage):
    """``plan`` with the bytes of the layer's weight (an embedding's table) and what it holds."""
    table = module.embedding if isinstance(module, nnx.Embed) else module.kernel
    nbytes, bf16 = kernel_sizes(table.get_value(), stored)
    weights = storage.label if stored is not None else None
    return dataclasses.replace(plan, weights=weights, nbytes=nbytes, bf16_nbytes=bf16, layer=layer)
