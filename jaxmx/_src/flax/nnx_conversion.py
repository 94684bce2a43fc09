"""Whole-model conversion of ``flax.nnx`` models, in place: :func:`quantize_model`.

The model's layers are found by ``nnx.iter_modules``, planned by
:meth:`~jaxmx._src.flax.rules.Conversion.plan`, and each converted layer gets a jaxmx hook:
``dot_general`` (``Linear``, ``LinearGeneral``), ``einsum_op`` (``Einsum``), ``attention_fn``
(``MultiHeadAttention`` with ``attention=True``), or a new :class:`~jaxmx.flax.MXRaggedDot`
(a module of experts holding one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from flax import nnx

from jaxmx._src.core.recipes import MXFP8, Recipe
from jaxmx._src.flax.conversion_report import ConversionReport
from jaxmx._src.flax.internals import nnx_dot_general_cls
from jaxmx._src.flax.nnx import Einsum, Linear
from jaxmx._src.flax.ops import (
    MXAttention,
    MXDotGeneral,
    MXEinsum,
    MXRaggedDot,
    ragged_dot_attributes,
)
from jaxmx._src.flax.rules import (
    ATTENTION,
    EMBEDDING,
    EXPERTS,
    GEMM,
    OWN,
    Conversion,
    Layer,
    Rule,
    dot_general_cls_refusal,
)

CONVERTIBLE = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)
"""The layer types :func:`quantize_model` converts."""


def quantize_model(
    model: nnx.Module,
    recipe: Recipe | Mapping[str, Recipe | None] | None = MXFP8,
    *,
    include: Rule = None,
    exclude: Rule = (),
    exclude_defaults: bool = True,
    attention: bool = False,
    keep: Rule = None,
    keep_last: int = 0,
    keep_recipe: Recipe | None = None,
) -> ConversionReport:
    """Routes the ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` layers of ``model``
    through jaxmx, in place, and reports what it did to each layer.

    The projections of ``nnx.MultiHeadAttention`` (``query``, ``key``, ``value``, ``out``) are
    ``LinearGeneral`` layers and are converted like any other. Only the layers' ``dot_general`` /
    ``einsum_op`` hooks change: parameters, their dtypes and the model's state tree are untouched,
    so optimizer state and checkpoints stay valid. jaxmx's own layers keep their recipe.

    Which layers: every layer unless an ``exclude`` pattern matches it, ``include`` (when given)
    does not, or a default exclusion holds: :data:`DEFAULT_EXCLUDE` (embeddings, output heads and
    MoE routers by name) or the output head by position (the only layer whose output width is
    the size of an ``nnx.Embed`` table of the model). An ``include`` pattern without wildcards
    that matches a layer (``include="head"``) wins over the default exclusions; ``exclude``
    wins over everything. Patterns (``fnmatch`` syntax) match the ``/``-joined layer path or any
    run of its components (``"attn/*"`` matches ``"blocks/0/attn/key"``).

    Per-layer precision: the converted layers that ``keep`` matches, and those of the last
    ``keep_last`` numbered blocks, get ``keep_recipe`` instead of ``recipe`` (by default plain
    high precision). A numbered block is the first path component that is an integer or ends
    in ``_<int>`` (``blocks/3/...``, ``layers_3/...``); blocks are counted per stack (the path
    before the number: ``blocks/``, ``decoder/layers_``), among the converted layers. Layers
    outside numbered blocks (``proj``, ``head``) are not affected by ``keep_last``.

    Args:
        model: any nnx module.
        recipe: a :class:`jaxmx.Recipe` (default :data:`jaxmx.recipes.MXFP8`); ``None`` restores
            plain high-precision ``lax.dot_general`` / ``jnp.einsum`` on the matched layers; or a
            per-layer mapping ``{pattern: Recipe or None}`` as for
            :func:`jaxmx.flax.linen.quantize_model`.
        include: ``None`` (every layer), pattern(s), or a predicate ``(path, layer) -> bool``.
        exclude: layers never to convert (same forms), besides the default exclusions.
        exclude_defaults: apply the default exclusions (``False``: only ``exclude``).
        attention: also compute the attention products (``QK^T``, ``PV``) of the matched
            ``nnx.MultiHeadAttention`` layers in MX formats (their ``attention_fn`` becomes
            :class:`jaxmx.flax.MXAttention`).
        keep: converted layers that get ``keep_recipe``, same forms as ``include``.
        keep_last: the number of final numbered blocks of each stack whose converted layers get
            ``keep_recipe`` (NVIDIA's NVFP4 recipe keeps the last blocks in higher precision).
        keep_recipe: the recipe of the kept layers: ``None`` (plain high precision, the
            default) or a :class:`jaxmx.Recipe` such as :data:`jaxmx.recipes.MXFP8`.

    Returns:
        ``{path: LayerPlan}`` for every GEMM-bearing layer (converted, kept, excluded, embedding
        tables, attention layers), in ``nnx.iter_modules`` order: the recipe it runs with, why,
        and the layer itself (``plan.layer``); ``report.converted`` holds the converted ones and
        ``print(report)`` shows a table.

    Raises:
        ValueError: ``include`` patterns that match none of the model's convertible layers, or
            ``keep`` patterns none of the converted ones (each named, with the layers listed);
            ``keep_last`` is negative, exceeds the number of blocks of a stack, or the converted
            layers lie in no numbered block; a matched layer sets ``dot_general_cls``, which Flax
            uses in place of ``dot_general``.
        TypeError: ``recipe`` or ``keep_recipe`` is neither a :class:`jaxmx.Recipe` nor ``None``,
            or a rule has another type.

    Warns:
        UserWarning: ``exclude`` patterns that match no convertible layer; ``attention=True`` on
        a model without ``nnx.MultiHeadAttention``.

    Example:
        >>> from flax import nnx
        >>> import jaxmx, jaxmx.flax.nnx as mxnnx
        >>> class Net(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.up = nnx.Linear(32, 64, rngs=rngs)
        ...         self.head = nnx.Linear(64, 10, rngs=rngs)
        >>> print(mxnnx.quantize_model(Net(nnx.Rngs(0))))
        head  Linear  high precision  excluded by default: 'head'
        up    Linear  MXFP8           converted

        The last of three blocks in high precision:

        >>> class Stack(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.blocks = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(3)])
        >>> report = mxnnx.quantize_model(Stack(nnx.Rngs(0)), jaxmx.recipes.MXFP8, keep_last=1)
        >>> {path: plan.recipe is None for path, plan in report.items()}
        {'blocks/0': False, 'blocks/1': False, 'blocks/2': True}
    """
    conversion = Conversion(
        recipe=recipe,
        include=include,
        exclude=exclude,
        exclude_defaults=exclude_defaults,
        attention=attention,
        keep=keep,
        keep_last=keep_last,
        keep_recipe=keep_recipe,
    )
    layers = [
        _layer("/".join(str(p) for p in path), module, role)
        for path, module in nnx.iter_modules(model)
        if (role := _role(module)) is not None
    ]
    report = conversion.plan(layers, in_call_order=False)
    for path, plan in report.converted.items():  # refuse before changing anything
        if isinstance(plan.layer, nnx.LinearGeneral) and nnx_dot_general_cls(plan.layer):
            raise dot_general_cls_refusal(path)
    for path, plan in report.converted.items():
        _convert(plan.layer, path, plan.recipe)
    return report


def _role(module: nnx.Module) -> str | None:
    if isinstance(module, (Linear, Einsum)):
        return OWN
    if isinstance(module, CONVERTIBLE):
        return GEMM
    if isinstance(module, nnx.MultiHeadAttention):
        return ATTENTION
    if isinstance(module, nnx.Embed):
        return EMBEDDING
    if ragged_dot_attributes(module):
        return EXPERTS
    return None


def _layer(path: str, module: nnx.Module, role: str) -> Layer:
    width = getattr(module, "out_features", None) if role == GEMM else None
    return Layer(
        path=path,
        kind=type(module).__name__,
        role=role,
        out_width=math.prod(width) if isinstance(width, tuple) else width,
        vocab=module.num_embeddings if role == EMBEDDING else None,
        recipe=module.recipe if role == OWN else None,
        module=module,
    )


def _convert(layer: nnx.Module, path: str, recipe: Recipe | None) -> None:
    """Sets the jaxmx hook of one converted layer."""
    experts = ragged_dot_attributes(layer)
    if experts:
        for attr in experts:
            setattr(layer, attr, MXRaggedDot(recipe, path))
    elif isinstance(layer, nnx.MultiHeadAttention):
        layer.attention_fn = MXAttention(recipe, path)
    elif isinstance(layer, nnx.Einsum):
        layer.einsum_op = MXEinsum(recipe, path)
    else:
        layer.dot_general = MXDotGeneral(recipe, path)
