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

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmx._src.core.recipes import MXFP8, Recipe
from jaxmx._src.flax.ops import MXAttention, MXDotGeneral, MXEinsum
from jaxmx._src.flax.rules import DEFAULT_EXCLUDE, Conversion, Rule, last_blocks


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
        return _einsum_call(self, inputs, einsum_str, self.recipe)


def _einsum_call(module: nn.Einsum, inputs, einsum_str, recipe):
    """Flax's ``Einsum.__call__`` on ``module`` (inside its compact scope), with the contraction
    routed through jaxmx."""
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
    y = MXEinsum(recipe)(
        einsum_str,
        inputs,
        kernel,
        precision=module.precision,
        preferred_element_type=module.preferred_element_type,
    )
    if bias is not None:
        y += jnp.reshape(bias, broadcasted_bias_shape)
    return y


# --- whole-model conversion -------------------------------------------------------------------

CONVERTIBLE = (nn.Dense, nn.DenseGeneral, nn.Einsum)
"""The layer types :func:`quantize_model` converts (``MultiHeadDotProductAttention``'s
projections are ``DenseGeneral`` layers)."""


def quantize_model(
    module: nn.Module,
    recipe: Recipe | None = MXFP8,
    *,
    include: Rule = None,
    exclude: Rule = DEFAULT_EXCLUDE,
    attention: bool = False,
    keep: Rule = None,
    keep_last: int = 0,
    keep_recipe: Recipe | None = None,
) -> nn.Module:
    """``module`` with its ``nn.Dense``, ``nn.DenseGeneral`` and ``nn.Einsum`` layers run through
    jaxmx, without touching its source.

    The result is an instance of a subclass of ``type(module)`` with the same fields, so its
    parameter tree is the same as ``module``'s: checkpoints interchange, and
    ``quantize_model(m).init`` gives the parameters ``m.init`` would. Its ``init``,
    ``init_with_output`` and ``apply`` run under Flax's method interception
    (``nn.intercept_methods``), which hands each matched layer's call a jaxmx ``dot_general``
    (``Dense``, ``DenseGeneral``, so also the attention projections) or the jaxmx contraction
    (``Einsum``). jaxmx's own layers keep their recipe. Use the result at the top level (its
    ``init`` / ``apply``).

    Args:
        module: a linen module (unbound).
        recipe: a :class:`jaxmx.Recipe`, or ``None`` for plain high precision.
        include, exclude: path rules as for :func:`jaxmx.flax.nnx.quantize_model`, matched
            against ``"/"``-joined module paths (e.g. ``"decoder/block_0/mlp/dense_0"``);
            ``exclude`` defaults to :data:`DEFAULT_EXCLUDE` (embeddings and output heads).
        attention: also compute the attention products (``QK^T``, ``PV``) of the matched
            ``nn.MultiHeadDotProductAttention`` layers in MX formats (their ``attention_fn``
            becomes :class:`jaxmx.flax.MXAttention`).
        keep, keep_last, keep_recipe: per-layer precision as for
            :func:`jaxmx.flax.nnx.quantize_model`: the converted layers that ``keep`` matches and
            those of the last ``keep_last`` numbered blocks of each stack (``layers_3``,
            ``blocks/3``, ``block_3``; Flax's automatic names such as ``Dense_3`` count too) get
            ``keep_recipe`` (default ``None``: plain high precision). To find the last blocks,
            each ``init`` / ``apply`` first traces the model abstractly (``jax.eval_shape``).

    Raises:
        TypeError: ``recipe`` or ``keep_recipe`` is neither a :class:`jaxmx.Recipe` nor ``None``.
        ValueError: ``keep_last`` is negative; or (from ``init`` / ``apply``) an ``include``
            pattern matched no convertible layer, a ``keep`` pattern no converted one,
            ``keep_last`` exceeds the blocks of a stack or the converted layers lie in no
            numbered block, or a matched layer sets ``dot_general_cls``.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmx.flax.linen as mxl
        >>> class MLP(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return nn.Dense(4, name="head")(nn.relu(nn.Dense(64, name="up")(x)))
        >>> model = mxl.quantize_model(MLP())
        >>> params = model.init(jax.random.key(0), jnp.ones((2, 32)))
        >>> jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, MLP().init(
        ...     jax.random.key(0), jnp.ones((2, 32))))
        True

        Per-layer precision: with the last 3 of 3 numbered blocks kept in high precision, the
        output is exactly the stock model's:

        >>> class Stack(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         for i in range(3):
        ...             x = nn.Dense(32, name=f"layers_{i}")(x)
        ...         return x
        >>> x = jnp.ones((2, 32))
        >>> params = Stack().init(jax.random.key(0), x)
        >>> kept = mxl.quantize_model(Stack(), keep_last=3)
        >>> bool((kept.apply(params, x) == Stack().apply(params, x)).all())
        True
    """
    conversion = Conversion(recipe, include, exclude, keep, keep_last, keep_recipe)
    cls = _quantized_class(type(module))
    fields = {
        f.name: getattr(module, f.name)
        for f in dataclasses.fields(module)
        if f.init and f.name not in ("parent", "name")
    }
    quantized = cls(**fields)
    object.__setattr__(quantized, "_jaxmx_interceptor", _Interceptor(conversion, attention))
    return quantized


@functools.cache
def _quantized_class(base: type) -> type:
    def intercepted(method_name):
        base_method = getattr(base, method_name)

        @functools.wraps(base_method)
        def method(self, *args, **kwargs):
            return self._jaxmx_interceptor.run(lambda: base_method(self, *args, **kwargs))

        return method

    names = ("init", "init_with_output", "apply")
    return type(base.__name__, (base,), {n: intercepted(n) for n in names})


@dataclasses.dataclass(eq=False)
class _Interceptor:
    """Hands matched layers a jaxmx GEMM; records the convertible layers it saw."""

    conversion: Conversion
    attention: bool
    seen: set = dataclasses.field(default_factory=set)  # paths of the convertible layers
    converted: set = dataclasses.field(default_factory=set)  # paths of the converted ones
    kept_blocks: frozenset | None = None  # None: the discovery pass, which converts nothing
    running: bool = False

    def run(self, fn):
        """``fn()`` (the model's ``init`` / ``apply``) with the matched layers converted."""
        if self.running:  # init -> init_with_output: already intercepted
            return fn()
        self.running = True
        try:
            if self.conversion.keep_last:
                self.kept_blocks = None
                with nn.intercept_methods(self):
                    jax.eval_shape(lambda: (fn(), None)[1])
                blocks = last_blocks(self.converted, self.conversion.keep_last)
            else:
                blocks = frozenset()
            self.seen.clear()
            self.converted.clear()
            self.kept_blocks = blocks
            with nn.intercept_methods(self):
                out = fn()
            self.conversion.check_patterns(
                self.seen, self.converted, "Dense, DenseGeneral or Einsum"
            )
            return out
        finally:
            self.running = False

    def __call__(self, next_fun, args, kwargs, context):
        layer = context.module
        kinds = CONVERTIBLE + ((nn.MultiHeadDotProductAttention,) if self.attention else ())
        jaxmx_layer = isinstance(layer, (Dense, DenseGeneral, Einsum))
        if context.method_name != "__call__" or not isinstance(layer, kinds) or jaxmx_layer:
            return next_fun(*args, **kwargs)
        path = "/".join(layer.path)
        self.seen.add(path)
        if not self.conversion.converts(path, layer):
            return next_fun(*args, **kwargs)
        self.converted.add(path)
        if self.kept_blocks is None:
            return next_fun(*args, **kwargs)
        recipe = self.conversion.recipe_of(path, layer, self.kept_blocks)
        if isinstance(layer, nn.MultiHeadDotProductAttention):
            object.__setattr__(layer, "attention_fn", MXAttention(recipe, path))
            return next_fun(*args, **kwargs)
        if isinstance(layer, nn.Einsum):
            return _einsum_call(layer, *args, recipe=recipe, **kwargs)
        if layer.dot_general_cls is not None:
            raise ValueError(
                f"quantize_model: layer {path!r} sets dot_general_cls, which Flax calls instead "
                "of its dot_general; exclude the layer or drop its dot_general_cls"
            )
        object.__setattr__(layer, "dot_general", MXDotGeneral(recipe, path))
        return next_fun(*args, **kwargs)
