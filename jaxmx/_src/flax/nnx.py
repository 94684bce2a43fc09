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

from jaxmx._src.flax.ops import MXAttention, MXDotGeneral, MXEinsum
from jaxmx._src.flax.rules import DEFAULT_EXCLUDE, Rule, matcher, unmatched_includes
from jaxmx._src.recipes import MXFP8, Recipe


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
) -> dict[str, nnx.Module]:
    """Routes the ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` layers of ``model``
    through jaxmx, in place.

    The projections of ``nnx.MultiHeadAttention`` (``query``, ``key``, ``value``, ``out``) are
    ``LinearGeneral`` layers and are converted like any other. Only the layers' ``dot_general`` /
    ``einsum_op`` hooks change: parameters, their dtypes and the model's state tree are untouched,
    so optimizer state and checkpoints stay valid.

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

    Returns:
        ``{path: layer}`` for every layer that was converted, in traversal order.

    Raises:
        ValueError: an ``include`` pattern matches none of the model's convertible layers (the
            message lists them), or a matched layer sets ``dot_general_cls``, which Flax uses in
            place of ``dot_general``.

    Example:
        >>> from flax import nnx
        >>> import jaxmx.flax.nnx as mxnnx
        >>> class Net(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.up = nnx.Linear(32, 64, rngs=rngs)
        ...         self.head = nnx.Linear(64, 10, rngs=rngs)
        >>> sorted(mxnnx.quantize_model(Net(nnx.Rngs(0))))
        ['up']
    """
    kinds = CONVERTIBLE + ((nnx.MultiHeadAttention,) if attention else ())
    layers = {
        "/".join(str(p) for p in path): layer
        for path, layer in nnx.iter_modules(model)
        if isinstance(layer, kinds)
    }
    unmatched = unmatched_includes(include, layers)
    if unmatched:
        raise ValueError(
            f"quantize_model: include pattern {unmatched[0]!r} matches no Linear, LinearGeneral "
            f"or Einsum layer; the model has {sorted(layers)}"
        )
    included = matcher(include, default=True)
    excluded = matcher(exclude, default=False)
    converted = {}
    for name, layer in layers.items():
        if not included(name, layer) or excluded(name, layer):
            continue
        if isinstance(layer, nnx.MultiHeadAttention):
            layer.attention_fn = MXAttention(recipe, name)
        elif isinstance(layer, nnx.Einsum):
            layer.einsum_op = MXEinsum(recipe, name)
        elif getattr(layer, "dot_general_cls", None) is not None:
            raise ValueError(
                f"quantize_model: layer {name!r} sets dot_general_cls, which Flax calls instead of "
                "its dot_general; exclude the layer or drop its dot_general_cls"
            )
        else:
            layer.dot_general = MXDotGeneral(recipe, name)
        layer.recipe = recipe
        converted[name] = layer
    return converted


CONVERTIBLE = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)
"""The layer types :func:`quantize_model` converts."""
