"""``flax.nnx`` layers whose matmuls run through :func:`jaxmx.dot_general`, and model conversion.

``Linear`` and ``Einsum`` are subclasses of ``nnx.Linear`` / ``nnx.Einsum`` that take the same
arguments plus ``recipe`` (default :data:`jaxmx.recipes.MXFP8`; ``None`` = plain high precision).
They only set Flax's own ``dot_general`` / ``einsum_op`` hook, so parameters (names, shapes,
``param_dtype``) and checkpoints are those of the stock layers.

:func:`quantize_model` converts the ``Linear`` / ``LinearGeneral`` / ``Einsum`` layers of an
existing model in place, leaving embeddings and output heads in high precision by default.

Example:
    >>> from flax import nnx
    >>> from jaxmx._src.flax.nnx import Linear
    >>> Linear(32, 16, recipe=None, rngs=nnx.Rngs(0)).dot_general.recipe is None
    True
"""

from __future__ import annotations

from flax import nnx

from jaxmx._src.core.recipes import MXFP8, Recipe
from jaxmx._src.flax.internals import nnx_dot_general_cls
from jaxmx._src.flax.ops import MXAttention, MXDotGeneral, MXEinsum
from jaxmx._src.flax.rules import DEFAULT_EXCLUDE, Conversion, Rule


class Linear(nnx.Linear):
    """``nnx.Linear`` computed with MX operands; ``recipe=None`` is exactly ``nnx.Linear``.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jaxmx.flax.nnx as mxnnx
        >>> mxnnx.Linear(32, 8, rngs=nnx.Rngs(0))(jnp.ones((2, 32))).shape
        (2, 8)
    """

    def __init__(
        self, in_features: int, out_features: int, *, recipe: Recipe | None = MXFP8, **kwargs
    ):
        if "dot_general" in kwargs:
            raise TypeError("pass either recipe= or dot_general=, not both")
        super().__init__(in_features, out_features, dot_general=MXDotGeneral(recipe), **kwargs)
        self.recipe = recipe


class Einsum(nnx.Einsum):
    """``nnx.Einsum`` whose contraction runs through ``jaxmx.dot_general``.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jaxmx.flax.nnx as mxnnx
        >>> layer = mxnnx.Einsum("btd,dnh->btnh", (32, 4, 8), rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((2, 3, 32))).shape
        (2, 3, 4, 8)
    """

    def __init__(
        self,
        einsum_str: str,
        kernel_shape,
        bias_shape=None,
        *,
        recipe: Recipe | None = MXFP8,
        **kwargs,
    ):
        if "einsum_op" in kwargs:
            raise TypeError("pass either recipe= or einsum_op=, not both")
        super().__init__(einsum_str, kernel_shape, bias_shape, einsum_op=MXEinsum(recipe), **kwargs)
        self.recipe = recipe


def quantize_model(
    model: nnx.Module,
    recipe: Recipe | None = MXFP8,
    *,
    include: Rule = None,
    exclude: Rule = DEFAULT_EXCLUDE,
    attention: bool = False,
    keep: Rule = None,
    keep_last: int = 0,
    keep_recipe: Recipe | None = None,
) -> dict[str, nnx.Module]:
    """Routes the ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` layers of ``model``
    through jaxmx, in place.

    The projections of ``nnx.MultiHeadAttention`` (``query``, ``key``, ``value``, ``out``) are
    ``LinearGeneral`` layers and are converted like any other. Only the layers' ``dot_general`` /
    ``einsum_op`` hooks change: parameters, their dtypes and the model's state tree are untouched,
    so optimizer state and checkpoints stay valid.

    Per-layer precision: the converted layers that ``keep`` matches, and those of the last
    ``keep_last`` numbered blocks, get ``keep_recipe`` instead of ``recipe`` (by default plain
    high precision). A numbered block is the first path component that is an integer or ends
    in ``_<int>`` (``blocks/3/...``, ``layers_3/...``); blocks are counted per stack (the path
    before the number: ``blocks/``, ``decoder/layers_``), among the converted layers. Layers
    outside numbered blocks (``proj``, ``head``) are not affected by ``keep_last``.

    Args:
        model: any nnx module.
        recipe: a :class:`jaxmx.Recipe` (default :data:`jaxmx.recipes.MXFP8`); ``None`` restores
            plain high-precision ``lax.dot_general`` / ``jnp.einsum`` on the matched layers.
        include: which layers to consider: ``None`` (all), ``fnmatch`` pattern(s) matched against
            the ``/``-joined layer path or any of its components, or a predicate
            ``(path, layer) -> bool``.
        exclude: layers to leave alone, same forms; default :data:`DEFAULT_EXCLUDE` (embeddings and
            output heads). Pass ``()`` to convert everything ``include`` matches.
        attention: also compute the attention products (``QK^T``, ``PV``) of the matched
            ``nnx.MultiHeadAttention`` layers in MX formats (their ``attention_fn`` becomes
            :class:`jaxmx.flax.MXAttention`); they are listed in the result too.
        keep: converted layers that get ``keep_recipe``, same forms as ``include``.
        keep_last: the number of final numbered blocks of each stack whose converted layers get
            ``keep_recipe`` (NVIDIA's NVFP4 recipe keeps the last blocks in higher precision).
        keep_recipe: the recipe of the kept layers: ``None`` (plain high precision, the
            default) or a :class:`jaxmx.Recipe` such as :data:`jaxmx.recipes.MXFP8`.

    Returns:
        ``{path: layer}`` for every layer that was converted, kept layers included, in
        traversal order. Each layer's ``recipe`` attribute is the recipe it got, so
        ``{p: l.recipe for p, l in quantize_model(...).items()}`` is the per-layer plan.

    Raises:
        ValueError: an ``include`` pattern matches none of the model's convertible layers, or a
            ``keep`` pattern none of the converted ones (the message lists them); ``keep_last``
            is negative, exceeds the number of blocks of a stack, or the converted layers lie in
            no numbered block; a matched layer sets ``dot_general_cls``, which Flax uses in
            place of ``dot_general``.
        TypeError: ``recipe`` or ``keep_recipe`` is neither a :class:`jaxmx.Recipe` nor ``None``.

    Example:
        >>> from flax import nnx
        >>> import jaxmx, jaxmx.flax.nnx as mxnnx
        >>> class Net(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.up = nnx.Linear(32, 64, rngs=rngs)
        ...         self.head = nnx.Linear(64, 10, rngs=rngs)
        >>> sorted(mxnnx.quantize_model(Net(nnx.Rngs(0))))
        ['up']

        The last of three blocks in high precision:

        >>> class Stack(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.blocks = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(3)])
        >>> converted = mxnnx.quantize_model(Stack(nnx.Rngs(0)), jaxmx.recipes.MXFP8, keep_last=1)
        >>> {path: layer.recipe is None for path, layer in converted.items()}
        {'blocks/0': False, 'blocks/1': False, 'blocks/2': True}
    """
    conversion = Conversion(recipe, include, exclude, keep, keep_last, keep_recipe)
    kinds = CONVERTIBLE + ((nnx.MultiHeadAttention,) if attention else ())
    layers = {
        "/".join(str(p) for p in path): layer
        for path, layer in nnx.iter_modules(model)
        if isinstance(layer, kinds)
    }
    selected = {name: layer for name, layer in layers.items() if conversion.converts(name, layer)}
    conversion.check_patterns(layers, selected, "Linear, LinearGeneral or Einsum")
    for name, layer_recipe in conversion.plan(selected).items():
        layer = selected[name]
        if isinstance(layer, nnx.MultiHeadAttention):
            layer.attention_fn = MXAttention(layer_recipe, name)
        elif isinstance(layer, nnx.Einsum):
            layer.einsum_op = MXEinsum(layer_recipe, name)
        elif nnx_dot_general_cls(layer) is not None:
            raise ValueError(
                f"quantize_model: layer {name!r} sets dot_general_cls, which Flax calls instead of "
                "its dot_general; exclude the layer or drop its dot_general_cls"
            )
        else:
            layer.dot_general = MXDotGeneral(layer_recipe, name)
        layer.recipe = layer_recipe
    return selected


CONVERTIBLE = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)
"""The layer types :func:`quantize_model` converts."""
