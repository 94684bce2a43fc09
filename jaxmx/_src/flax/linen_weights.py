"""Weights at rest for ``flax.linen`` models: :func:`quantize_weights`.

An abstract pass (``jax.eval_shape`` of ``module.apply`` on the model's inputs, under Flax's
method interception) finds the model's layers in call order; they are planned by
:meth:`~jaxmx._src.flax.rules.Conversion.plan` (the rules of ``quantize_model``), and each
converted ``nn.Dense`` / ``nn.DenseGeneral`` gets its kernel stored as an
:class:`~jaxmx.MXArray` in the variables (:mod:`jaxmx._src.flax.weights`). The returned module
is an instance of a subclass of the model's class with one more dataclass field,
``jaxmx_weights`` (a frozen :class:`WeightsPlan`); each of its methods runs under an interceptor
that computes the converted layers from their stored weights (:func:`jaxmx.weight_matmul`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import flax.linen as nn
import jax

from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.flax.conversion_report import ConversionReport, LayerPlan
from jaxmx._src.flax.linen_conversion import method_names
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

_FIELD = "jaxmx_weights"
_EINSUM_NOTE = (
    "not converted: Einsum's contracting axes are set by its equation; weights at rest take "
    "Dense / DenseGeneral"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightsPlan:
    """What the module of :func:`quantize_weights` computes from stored weights: how they are
    stored, and the conversion's plan of each layer (its report)."""

    storage: WeightStorage
    plans: tuple[LayerPlan, ...]

    @property
    def paths(self) -> tuple[str, ...]:
        """The paths of the converted layers."""
        return tuple(p.path for p in self.plans if p.converted)

    @property
    def report(self) -> ConversionReport:
        return ConversionReport(self.plans)


def quantize_weights(
    module: nn.Module,
    variables,
    fmt: str,
    *args,
    tile: tuple[int, int] | None = None,
    activations: bool = False,
    include: Rule = None,
    exclude: Rule = (),
    exclude_defaults: bool = True,
    method=None,
    **kwargs,
) -> tuple[nn.Module, dict]:
    """A trained linen model for inference with its GEMM weights stored as
    :class:`jaxmx.MXArray`\\ s: ``(module, variables)``; :func:`weights_report` says what it
    did to each layer, with the bytes.

    ``*args, **kwargs`` are the model's inputs (arrays or ``jax.ShapeDtypeStruct``, as for
    ``apply``): an abstract ``module.apply(variables, *args, method=method, **kwargs)`` (nothing
    is computed) finds the layers in call order. The layers are chosen as by
    :func:`jaxmx.flax.linen.quantize_model` (same ``include`` / ``exclude`` patterns and default
    exclusions: embeddings, output heads, routers). Each converted ``nn.Dense`` /
    ``nn.DenseGeneral`` gets, at its kernel's path in the returned variables,
    ``jaxmx.quantize(kernel.reshape(K, N).T, fmt, axis=-1, tile=tile)`` (quantized along K, the
    contracted dims); the returned module computes those layers from it. A layer that sets its
    own ``dot_general`` / ``dot_general_cls`` hook is not converted (its stored weight would
    bypass the hook). ``nn.Embed`` tables stay as they are and ``nn.Einsum``
    layers are not converted; the report lists both, with why. The returned module runs with
    ``apply`` on the returned variables only (it cannot ``init``); it is forward only.

    Args:
        module: a linen module (unbound).
        variables: its trained variables (``{"params": ...}``, as ``init`` returns them).
        fmt: a format of :data:`jaxmx.FORMATS`: ``"mxfp8_e4m3"``, ``"mxfp4"``, ``"nvfp4"``,
            ``"fp8_e4m3_block"``, ...
        tile, activations: as for :func:`jaxmx.flax.nnx.quantize_weights`.
        include, exclude, exclude_defaults: as for :func:`jaxmx.flax.linen.quantize_model`.
        method: the method the abstract pass calls (default ``__call__``).

    Returns:
        ``(module, variables)``: the converted module (its report: :func:`weights_report`) and
        the variables with the stored weights.

    Raises:
        ValueError: an ``include`` pattern matches no convertible layer; nothing to convert;
            ``variables`` has no ``"params"``; a bad ``tile``.
        TypeError: ``module`` is a result of ``quantize_model`` or ``quantize_weights``; the
            converted model is differentiated (it is forward only).

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmx.flax.linen as mxl
        >>> class MLP(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return nn.Dense(10, name="head")(nn.relu(nn.Dense(64, name="up")(x)))
        >>> x = jnp.ones((2, 32), jnp.bfloat16)
        >>> variables = MLP().init(jax.random.key(0), x)
        >>> model, qvars = mxl.quantize_weights(MLP(), variables, "mxfp4", x)
        >>> print(mxl.weights_report(model))
        up     Dense  mxfp4, weights only  1,088 B (0.27x bf16)  converted
        head   Dense  high precision       2,560 B (2.00x bf16)  excluded by default: 'head'
        total                              3,648 B (0.68x bf16)
        >>> type(qvars["params"]["up"]["kernel"]).__name__, model.apply(qvars, x).shape
        ('MXArray', (2, 10))
    """
    storage = WeightStorage(fmt=fmt, tile=tile, activations=activations)
    conversion = weights_conversion(
        include=include, exclude=exclude, exclude_defaults=exclude_defaults
    )
    if not isinstance(module, nn.Module):
        raise TypeError(f"quantize_weights: module must be a flax.linen Module, got {module!r}")
    for field in ("jaxmx_conversion", _FIELD):
        if getattr(module, field, None) is not None:
            raise TypeError(
                f"quantize_weights: module is already converted ({field}); pass the trained "
                "model itself"
            )
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise ValueError(
            "quantize_weights: variables must be the model's variables ({'params': ...}, as "
            f"init returns them), got a {type(variables).__name__} without 'params'"
        )
    layers = _layers(module, variables, args, kwargs, method)
    report = conversion.plan(layers)
    if not report.converted:
        raise ValueError(f"quantize_weights: no layer of the model to convert:\n{report}")
    params = dict(variables["params"])  # _params_at copies the dicts on each layer's path
    plans = []
    for layer in layers:
        plan = report[layer.path]
        name = "embedding" if layer.role == EMBEDDING else "kernel"
        table = nn.meta.unbox(_params_at(params, layer.path, name))  # a LogicallyPartitioned box
        stored = None
        if plan.converted:
            axes, features = _axes_and_features(layer.module)
            stored = stored_weight(table, axes, features, storage, layer.path)
            _params_at(params, layer.path, None)["kernel"] = stored
        nbytes, bf16 = kernel_sizes(table, stored)
        weights = storage.label if stored is not None else None
        plans.append(
            dataclasses.replace(plan, weights=weights, nbytes=nbytes, bf16_nbytes=bf16, layer=None)
        )
    fields = {
        f.name: getattr(module, f.name)
        for f in dataclasses.fields(module)
        if f.init and f.name not in ("parent", "name")
    }
    weights_plan = WeightsPlan(storage=storage, plans=tuple(plans))
    converted = _converted_class(type(module))(**fields, **{_FIELD: weights_plan})
    return converted, {**variables, "params": params}


def weights_report(module: nn.Module) -> ConversionReport:
    """What :func:`quantize_weights` did to each layer of the model it returned: ``{path:
    LayerPlan}`` in call order, with each layer's stored format (``plan.weights``),
    ``plan.nbytes`` (its kernel, or an embedding's table, as stored) and ``plan.bf16_nbytes``;
    ``report.nbytes`` / ``report.bf16_nbytes`` are the totals and ``print(report)`` the table.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmx.flax.linen as mxl
        >>> x = jnp.ones((2, 64))
        >>> model, _ = mxl.quantize_weights(nn.Dense(8), nn.Dense(8).init(jax.random.key(0), x),
        ...                                 "mxfp8_e4m3", x)
        >>> report = mxl.weights_report(model)
        >>> report[""].nbytes, report.bf16_nbytes
        (528, 1024)
    """
    plan = getattr(module, _FIELD, None)
    if plan is None:
        raise TypeError(
            "weights_report: module must be a result of jaxmx.flax.linen.quantize_weights, got a "
            f"{type(module).__name__}"
        )
    return plan.report


# --- finding the layers --------------------------------------------------------------------------


def _layers(module: nn.Module, variables, args, kwargs, method) -> list[Layer]:
    """The Dense / DenseGeneral / Einsum / Embed layers ``module`` calls, in call order, from an
    abstract ``apply``."""
    seen: dict[str, Layer] = {}

    def record(next_fun, call_args, call_kwargs, context):
        layer = context.module
        out = next_fun(*call_args, **call_kwargs)
        path = "/".join(layer.path)
        if path not in seen and (found := _layer(layer, path, context.method_name, out)):
            seen[path] = found
        return out

    def run(variables):
        with nn.intercept_methods(record):
            module.apply(variables, *args, mutable=True, method=method, **kwargs)

    jax.eval_shape(run, variables)
    return list(seen.values())


def _layer(layer: nn.Module, path: str, method_name: str, out) -> Layer | None:
    kind = type(layer).__name__
    if not isinstance(layer, (nn.Embed, nn.Einsum, nn.Dense, nn.DenseGeneral)):
        return None
    unbound = layer.clone(parent=None)
    if isinstance(layer, nn.Embed):
        if method_name not in ("__call__", "attend"):
            return None
        return Layer(
            path=path, kind=kind, role=EMBEDDING, vocab=layer.num_embeddings, module=unbound
        )
    if method_name != "__call__":
        return None
    if isinstance(layer, nn.Einsum):
        return Layer(path=path, kind=kind, role=REFUSED, note=_EINSUM_NOTE, module=unbound)
    note = _refusal(layer)
    role = GEMM if note is None else REFUSED
    width = math.prod(out.shape[-1:]) if hasattr(out, "shape") else None
    return Layer(path=path, kind=kind, role=role, note=note, out_width=width, module=unbound)


def _refusal(layer: nn.Module) -> str | None:
    base = nn.Dense if isinstance(layer, nn.Dense) else nn.DenseGeneral
    below = type(layer).__mro__[: type(layer).__mro__.index(base)]
    if any("__call__" in vars(cls) for cls in below):
        return f"not converted: {type(layer).__name__} overrides {base.__name__}.__call__"
    if isinstance(layer, nn.DenseGeneral) and layer.batch_dims:
        return "not converted: DenseGeneral with batch_dims"
    return hook_refusal(layer)


def _axes_and_features(layer: nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if isinstance(layer, nn.Dense):
        return (-1,), (layer.features,)
    axes = layer.axis if isinstance(layer.axis, tuple | list) else (layer.axis,)
    features = layer.features if isinstance(layer.features, tuple | list) else (layer.features,)
    return tuple(axes), tuple(features)


def _params_at(params: dict, path: str, name: str | None):
    """The dict of the layer at ``path`` in ``params`` (made a fresh dict, so the caller's
    variables are not changed), or its entry ``name``."""
    node = params
    for part in path.split("/") if path else ():
        node[part] = dict(node[part])
        node = node[part]
    return node if name is None else node[name]


# --- the converted class -------------------------------------------------------------------------


@functools.cache
def _converted_class(base: type) -> type:
    """``base`` with the ``jaxmx_weights`` field, each of its methods computing the converted
    layers from their stored weights."""
    namespace = {name: _weighted(getattr(base, name)) for name in method_names(base)}
    namespace.update(
        __annotations__={_FIELD: "WeightsPlan | None"},
        __module__=base.__module__,
        __qualname__=base.__qualname__,
        **{_FIELD: None},
    )
    return type(base.__name__, (base,), namespace)


def _weighted(base_method):
    @functools.wraps(base_method, updated=())
    def method(self, *args, **kwargs):
        plan = getattr(self, _FIELD)
        if plan is None or self.scope is None:
            return base_method(self, *args, **kwargs)
        with nn.intercept_methods(functools.partial(_intercept, root=self, plan=plan)):
            return base_method(self, *args, **kwargs)

    return method


def _intercept(next_fun, args, kwargs, context, *, root: nn.Module, plan: WeightsPlan):
    """Computes a converted Dense / DenseGeneral call of ``root``'s from its stored weight."""
    layer = context.module
    prefix = len(root.path)
    if (
        context.method_name != "__call__"
        or not isinstance(layer, (nn.Dense, nn.DenseGeneral))
        or layer.path[:prefix] != root.path
        or "/".join(layer.path[prefix:]) not in plan.paths
    ):
        return next_fun(*args, **kwargs)
    path = "/".join(layer.path[prefix:])
    kernel = layer.get_variable("params", "kernel")
    if not isinstance(kernel, MXArray):
        raise TypeError(
            f"quantize_weights: layer {path!r} computes from its stored weight (an MXArray at "
            f"params/{path}/kernel), found {type(kernel).__name__}; apply the module to the "
            "variables quantize_weights returned (it cannot init)"
        )
    bias = layer.get_variable("params", "bias") if layer.use_bias else None
    (x,) = args
    axes, features = _axes_and_features(layer)
    return dense_forward(
        x,
        kernel,
        bias,
        axes=axes,
        features=features,
        storage=plan.storage,
        dtype=x.dtype if layer.dtype is None else layer.dtype,
    )
