"""``flax.nnx`` layers whose matmuls run through :func:`jaxmx.dot_general`, and model conversion.

``Linear`` and ``Einsum`` are subclasses of ``nnx.Linear`` / ``nnx.Einsum`` that take the same
arguments plus ``recipe`` (default :data:`jaxmx.recipes.MXFP8`; ``None`` = plain high precision).
They only set Flax's own ``dot_general`` / ``einsum_op`` hook, so parameters (names, shapes,
``param_dtype``) and checkpoints are those of the stock layers.

Whole-model conversion is in :mod:`jaxmx._src.flax.nnx_conversion`.

Example:
    >>> from flax import nnx
    >>> from jaxmx._src.flax.nnx import Linear
    >>> Linear(32, 16, recipe=None, rngs=nnx.Rngs(0)).dot_general.recipe is None
    True
"""

from __future__ import annotations

from flax import nnx

from jaxmx._src.core.recipes import MXFP8, Recipe
from jaxmx._src.flax.ops import MXDotGeneral, MXEinsum


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
