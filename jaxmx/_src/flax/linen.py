"""``flax.linen`` layers whose matmuls run through :func:`jaxmx.dot_general`.

``Dense``, ``DenseGeneral`` and ``Einsum`` take exactly the arguments of their Flax namesakes plus
``recipe`` (default :data:`jaxmx.recipes.MXFP8`; ``None`` = plain high precision). They are
subclasses of the Flax layers with the same parameter names, shapes and dtypes, so parameters and
checkpoints are interchangeable with the stock layers.

To quantize a stock layer instead, pass :func:`dot_general`:

    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmx.flax.linen as mxl
    >>> layer = nn.Dense(16, dot_general=mxl.dot_general())   # recipe defaults to MXFP8
    >>> y, _ = layer.init_with_output(jax.random.key(0), jnp.ones((4, 32)))
    >>> y.shape
    (4, 16)
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxmx._src.core.recipes import MXFP8, Recipe
from jaxmx._src.flax.ops import MXDotGeneral, MXEinsum


def dot_general(recipe: Recipe | None = MXFP8) -> MXDotGeneral:
    """A ``dot_general`` for the ``dot_general=`` argument of ``nn.Dense`` / ``nn.DenseGeneral``.

    Args:
        recipe: a :class:`jaxmx.Recipe` (default :data:`jaxmx.recipes.MXFP8`), or ``None`` for
            ``lax.dot_general``.
    """
    return MXDotGeneral(recipe)


class _RecipeDotGeneral:
    """Mixin: derives the Flax ``dot_general`` attribute from ``recipe`` when none is given."""

    def __post_init__(self):
        dg = self.dot_general
        if self.dot_general_cls is None and (dg is None or isinstance(dg, MXDotGeneral)):
            # Also refreshes a derived dot_general after ``clone(recipe=...)``.
            object.__setattr__(self, "dot_general", MXDotGeneral(self.recipe))
        super().__post_init__()


class Dense(_RecipeDotGeneral, nn.Dense):
    """``flax.linen.Dense`` computed with MX operands; ``recipe=None`` is exactly ``nn.Dense``.

    Example:
        >>> import jax, jax.numpy as jnp, jaxmx.flax.linen as mxl
        >>> y, params = mxl.Dense(8).init_with_output(jax.random.key(0), jnp.ones((2, 32)))
        >>> y.shape, params["params"]["kernel"].shape
        ((2, 8), (32, 8))
    """

    recipe: Recipe | None = MXFP8


class DenseGeneral(_RecipeDotGeneral, nn.DenseGeneral):
    """``flax.linen.DenseGeneral`` computed with MX operands; ``recipe=None`` is exactly Flax's."""

    recipe: Recipe | None = MXFP8


class Einsum(nn.Einsum):
    """``flax.linen.Einsum`` whose contraction runs through ``jaxmx.dot_general``.

    ``recipe=None`` is exactly ``nn.Einsum``.

    Example:
        >>> import jax, jax.numpy as jnp, jaxmx.flax.linen as mxl
        >>> layer = mxl.Einsum((4, 32, 8), "abc,acd->abd")
        >>> layer.init_with_output(jax.random.key(0), jnp.ones((4, 2, 32)))[0].shape
        (4, 2, 8)
    """

    recipe: Recipe | None = MXFP8

    @nn.compact
    def __call__(self, inputs, einsum_str: str | None = None):
        return einsum_call(self, inputs, einsum_str, recipe=self.recipe)


def einsum_call(
    module: nn.Einsum, inputs, einsum_str=None, *, recipe: Recipe | None, name: str | None = None
):
    """Flax's ``Einsum.__call__`` on ``module`` (inside its compact scope), with the contraction
    routed through jaxmx with ``recipe`` (``name``: its telemetry name)."""
    einsum_str = nn.merge_param("einsum_str", module.einsum_str, einsum_str)
    einsum_str = einsum_str.replace(" ", "")
    if "->" not in einsum_str:
        raise ValueError('`einsum_str` equation must be explicit and include "->".')
    if einsum_str.count(",") != 1:
        raise ValueError(
            "`einsum_str` equation must have exactly two operands and therefore, exactly one "
            f"comma character, instead of {einsum_str.count(',')}"
        )
    kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
    if module.use_bias:
        bias_shape, broadcasted_bias_shape = module._get_bias_shape(einsum_str, inputs, kernel)
        bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
    else:
        bias = None
    inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
    y = MXEinsum(recipe, name)(
        einsum_str,
        inputs,
        kernel,
        precision=module.precision,
        preferred_element_type=module.preferred_element_type,
    )
    if bias is not None:
        y += jnp.reshape(bias, broadcasted_bias_shape)
    return y
