"""Whole-model conversion of ``flax.linen`` modules: :func:`quantize_model` and
:func:`conversion_report`.

A converted module is an instance of a subclass of the model's class with one more dataclass
field, ``jaxmx_conversion`` (a frozen :class:`~jaxmx._src.flax.rules.Conversion`), so two
conversions compare and hash equal exactly when they compute the same thing, and ``clone``,
``copy`` and ``bind`` keep it. Every method of the model runs under Flax's method
interception (``nn.intercept_methods``), however it is reached: ``init`` / ``apply``, a bound
module, a submodule of another model, ``nn.tabulate``, lifted transforms. On entry, an abstract
pass (``jax.eval_shape`` of the same method on a copy of the module) finds the model's layers
in call order, the conversion plans them (:meth:`Conversion.plan`: what to convert, the output
head, the kept blocks), and the real call hands each converted layer a jaxmx GEMM.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping

import flax.linen as nn
import jax

from jaxmx._src.core.recipes import MXFP8, Recipe
from jaxmx._src.flax.conversion_report import ConversionReport
from jaxmx._src.flax.internals import linen_rng_streams
from jaxmx._src.flax.linen import Dense, DenseGeneral, Einsum, einsum_call
from jaxmx._src.flax.ops import MXAttention, MXDotGeneral, MXRaggedDot, ragged_dot_attributes
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

CONVERTIBLE = (nn.Dense, nn.DenseGeneral, nn.Einsum)
"""The layer types :func:`quantize_model` converts (``MultiHeadDotProductAttention``'s
projections are ``DenseGeneral`` layers)."""

_FIELD = "jaxmx_conversion"


def quantize_model(
    module: nn.Module,
    recipe: Recipe | Mapping[str, Recipe | None] | None = MXFP8,
    *,
    include: Rule = None,
    exclude: Rule = (),
    exclude_defaults: bool = True,
    attention: bool = False,
    keep: Rule = None,
    keep_last: int = 0,
    keep_recipe: Recipe | None = None,
) -> nn.Module:
    """``module`` with its ``nn.Dense``, ``nn.DenseGeneral`` and ``nn.Einsum`` layers run through
    jaxmx, without touching its source.

    The result is an instance of a subclass of ``type(module)`` with the same fields plus
    ``jaxmx_conversion`` (what to convert, to what), so its parameter tree is ``module``'s
    (checkpoints interchange) and two results compare equal exactly when they compute the same
    thing (a static ``jax.jit`` argument recompiles for another recipe). The conversion holds
    however the result is used: ``init`` / ``apply`` (any ``method=``), ``bind``, as a submodule,
    ``clone`` / ``copy``, ``nn.tabulate``, inside ``nn.scan`` / ``nn.remat`` / ``nn.vmap``.
    :func:`conversion_report` lists what it does to each layer. jaxmx's own layers keep their
    recipe.

    Args:
        module: a linen module (unbound).
        recipe: a :class:`jaxmx.Recipe`, or ``None`` for plain high precision; or a per-layer
            mapping ``{pattern: Recipe or None}`` (the first pattern matching a converted layer
            gives its recipe; a converted layer no pattern matches raises, so add ``"*"`` for
            the others; :func:`jaxmx.diagnostics.advised_recipes` returns one).
        include: ``None`` (every layer), ``fnmatch`` pattern(s) matched against the
            ``"/"``-joined module path or any run of its components (``"attn/*"`` matches
            ``"blocks/0/attn/key"``), or a predicate ``(path, layer) -> bool``.
        exclude: layers never to convert (same forms), besides the default exclusions.
        exclude_defaults: apply the default exclusions: :data:`DEFAULT_EXCLUDE` (embeddings,
            output heads, MoE routers by name) and the output head by position (the last
            projection, when its width is the size of an ``nn.Embed`` table of the model). An
            ``include`` pattern without wildcards that matches a layer wins over them.
        attention: also compute the attention products (``QK^T``, ``PV``) of the matched
            ``nn.MultiHeadDotProductAttention`` layers in MX formats (their ``attention_fn``
            becomes :class:`jaxmx.flax.MXAttention`).
        keep, keep_last, keep_recipe: per-layer precision as for
            :func:`jaxmx.flax.nnx.quantize_model`: the converted layers that ``keep`` matches and
            those of the last ``keep_last`` numbered blocks of each stack (``layers_3``,
            ``blocks/3``, ``block_3``; Flax's automatic names such as ``Dense_3`` count too) get
            ``keep_recipe`` (default ``None``: plain high precision).

    Raises:
        TypeError: ``recipe`` or ``keep_recipe`` is neither a :class:`jaxmx.Recipe` nor
            ``None``, or a rule has another type.
        ValueError: ``keep_last`` is negative; or (when the model runs) ``include`` patterns
            that match no convertible layer (all named), ``keep`` patterns that match no
            converted one, ``keep_last`` exceeds the blocks of a stack or the converted layers
            lie in no numbered block, or a matched layer sets ``dot_general_cls``.

    Warns:
        UserWarning: (when the model runs) ``exclude`` patterns that match no convertible layer;
        ``attention=True`` on a model without ``nn.MultiHeadDotProductAttention``.

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
        >>> print(mxl.conversion_report(model, jnp.ones((2, 32))))
        up    Dense  MXFP8           converted
        head  Dense  high precision  excluded by default: 'head'
        >>> model == mxl.quantize_model(MLP()), model == mxl.quantize_model(MLP(), None)
        (True, False)
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
    if not isinstance(module, nn.Module):
        raise TypeError(f"quantize_model: module must be a flax.linen Module, got {module!r}")
    base = _base_class(type(module))
    fields = {
        f.name: getattr(module, f.name)
        for f in dataclasses.fields(module)
        if f.init and f.name not in ("parent", "name", _FIELD)
    }
    return _converted_class(base)(**fields, **{_FIELD: conversion})


def conversion_report(
    module: nn.Module, *args, rngs=None, method=None, **kwargs
) -> ConversionReport:
    """What :func:`quantize_model`'s result does to each GEMM-bearing layer of ``module``,
    found by an abstract ``module.init(rngs, *args, method=method, **kwargs)`` (nothing is
    computed).

    Args:
        module: a result of :func:`quantize_model`.
        *args, **kwargs: the model's inputs (arrays or ``jax.ShapeDtypeStruct``), as for
            ``init``.
        rngs: as for ``init`` (default ``jax.random.key(0)``).
        method: as for ``init``.

    Returns:
        ``{path: LayerPlan}`` in call order: each ``Dense`` / ``DenseGeneral`` / ``Einsum``,
        attention and embedding layer with the recipe it runs with and why.

    Example:
        >>> import jax.numpy as jnp, flax.linen as nn, jaxmx.flax.linen as mxl
        >>> report = mxl.conversion_report(mxl.quantize_model(nn.Dense(8)), jnp.ones((2, 32)))
        >>> [(p.kind, p.reason) for p in report.values()]
        [('Dense', 'converted')]
    """
    if getattr(module, _FIELD, None) is None:
        raise TypeError(
            f"conversion_report: module must be a result of jaxmx.flax.linen.quantize_model, got "
            f"a {type(module).__name__}"
        )
    reports: list[ConversionReport] = []
    token = _reports.set(reports)
    try:
        rngs = jax.random.key(0) if rngs is None else rngs
        jax.eval_shape(functools.partial(module.init, method=method, **kwargs), rngs, *args)
    finally:
        _reports.reset(token)
    return ConversionReport(dataclasses.replace(plan, layer=None) for plan in reports[0].values())


# --- the converted class -----------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Frame:
    """A converted module being called: the layers its abstract pass records, or the plan its
    real call applies."""

    root: nn.Module | None  # the converted module (None until its method is entered)
    recording: list[Layer | None] | None  # the abstract pass: the layers seen, in call order
    report: ConversionReport | None = None  # the real call: what to do to each layer


_frames: contextvars.ContextVar[tuple[_Frame, ...]] = contextvars.ContextVar("frames", default=())
_reports: contextvars.ContextVar[list | None] = contextvars.ContextVar("reports", default=None)


def _base_class(cls: type) -> type:
    return getattr(cls, "_jaxmx_base", cls)


@functools.cache
def _converted_class(base: type) -> type:
    """``base`` with the ``jaxmx_conversion`` field, each of its methods run under conversion."""
    namespace = {name: _converting(getattr(base, name)) for name in method_names(base)}
    namespace.update(
        __annotations__={_FIELD: "Conversion | None"},
        __module__=base.__module__,
        __qualname__=base.__qualname__,
        _jaxmx_base=base,
        **{_FIELD: None},
    )
    return type(base.__name__, (base,), namespace)


def method_names(base: type) -> list[str]:
    """The methods of ``base`` a user calls: those its classes below ``nn.Module`` define (and
    ``__call__``), without properties, static and class methods, ``setup`` or private names."""
    names = set()
    for cls in base.__mro__:
        if cls is nn.Module or not issubclass(cls, nn.Module):
            continue
        for name, attr in vars(cls).items():
            flax_api = hasattr(nn.Module, name) and name != "__call__"
            public = name == "__call__" or not name.startswith("_")
            if public and not flax_api and name != "setup" and inspect.isfunction(attr):
                names.add(name)
    return sorted(names)


def _converting(base_method: Callable) -> Callable:
    @functools.wraps(base_method, updated=())
    def method(self, *args, **kwargs):
        frames = _frames.get()
        conversion = getattr(self, _FIELD)
        if conversion is None or self.scope is None or (frames and frames[-1].root is self):
            return base_method(self, *args, **kwargs)  # unconverted, unbound, or self calls self
        if frames and frames[-1].root is None:  # the abstract pass of this module
            frames[-1].root = self
            return base_method(self, *args, **kwargs)
        if any(f.recording is not None for f in frames):  # inside another's abstract pass
            with _entered(_Frame(self, recording=[])):
                return base_method(self, *args, **kwargs)
        layers = _abstract_pass(self, base_method.__name__, args, kwargs)
        report = conversion.plan(layers)
        if _reports.get() is not None:
            _reports.get().append(report)
        with _entered(_Frame(self, recording=None, report=report)):
            return base_method(self, *args, **kwargs)

    return method


@contextlib.contextmanager
def _entered(frame: _Frame):
    """``frame`` on top of the stack, with the interceptor installed by the outermost one."""
    outermost = not _frames.get()
    token = _frames.set((*_frames.get(), frame))
    try:
        if outermost:
            with nn.intercept_methods(_intercept):
                yield
        else:
            yield
    finally:
        _frames.reset(token)


def _abstract_pass(module: nn.Module, method_name: str, args, kwargs) -> list[Layer]:
    """The layers ``module``'s method meets, in call order, from ``jax.eval_shape`` of the method
    on an unbound copy (``init`` while ``module`` initializes, else ``apply`` on its
    variables)."""
    frame = _Frame(None, recording=[])
    copy = module.clone(parent=None)
    rngs = {stream: jax.random.key(0) for stream in linen_rng_streams(module)}
    method = None if method_name == "__call__" else method_name

    def run(variables):
        with _entered(frame):
            if module.is_initializing():
                copy.init(rngs, *args, method=method, **kwargs)
            else:
                copy.apply(variables, *args, rngs=rngs, mutable=True, method=method, **kwargs)

    jax.eval_shape(run, module.variables)
    return [layer for layer in frame.recording if layer is not None]


# --- the interceptor -----------------------------------------------------------------------------


def _intercept(next_fun, args, kwargs, context):
    """Records (abstract pass) or converts (real call) each layer of the innermost converted
    module."""
    frame = _frames.get()[-1] if _frames.get() else None
    layer = context.module
    if frame is None or frame.root is None or _nested(layer, frame.root):
        return next_fun(*args, **kwargs)
    role = _role(layer, context.method_name)
    if role is None:
        return next_fun(*args, **kwargs)
    path = _relative_path(layer, frame.root)
    if frame.recording is not None:
        first = all(seen is None or seen.path != path for seen in frame.recording)
        index = len(frame.recording)
        frame.recording.append(None)  # its place in call order, filled in with its output width
        out = next_fun(*args, **kwargs)
        frame.recording[index] = _layer(layer, path, role, out) if first else None
        return out
    plan = frame.report.get(path)
    if plan is None:
        raise RuntimeError(
            f"quantize_model: layer {path!r} runs in this call but not in its abstract pass "
            "(which planned the conversion); the model's layers must not depend on the values "
            "of its inputs"
        )
    if not plan.converted or role not in (GEMM, EXPERTS, ATTENTION):
        return next_fun(*args, **kwargs)
    name = "/".join(layer.path)
    if role == EXPERTS:
        for attr in ragged_dot_attributes(layer):
            object.__setattr__(layer, attr, MXRaggedDot(plan.recipe, name))
        return next_fun(*args, **kwargs)
    if role == ATTENTION:
        object.__setattr__(layer, "attention_fn", MXAttention(plan.recipe, name))
        return next_fun(*args, **kwargs)
    if isinstance(layer, nn.Einsum):
        return einsum_call(layer, *args, recipe=plan.recipe, name=name, **kwargs)
    if layer.dot_general_cls is not None:
        raise dot_general_cls_refusal(path)
    object.__setattr__(layer, "dot_general", MXDotGeneral(plan.recipe, name))
    return next_fun(*args, **kwargs)


def _role(layer: nn.Module, method_name: str) -> str | None:
    """What ``layer``'s ``method_name`` call is to a conversion (see rules), or ``None``."""
    if isinstance(layer, nn.Embed):
        return EMBEDDING if method_name in ("__call__", "attend") else None
    if method_name != "__call__":
        return None
    if isinstance(layer, (Dense, DenseGeneral, Einsum)):
        return OWN
    if isinstance(layer, CONVERTIBLE):
        return GEMM
    if isinstance(layer, nn.MultiHeadDotProductAttention):
        return ATTENTION
    if ragged_dot_attributes(layer):
        return EXPERTS
    return None


def _nested(layer: nn.Module, root: nn.Module) -> bool:
    """Whether ``layer`` is another converted module (which converts its own layers)."""
    return layer is not root and getattr(layer, _FIELD, None) is not None


def _relative_path(layer: nn.Module, root: nn.Module) -> str:
    return "/".join(layer.path[len(root.path) :])


def _layer(layer: nn.Module, path: str, role: str, out) -> Layer:
    shape = getattr(out, "shape", None)
    return Layer(
        path=path,
        kind=type(layer).__name__,
        role=role,
        out_width=shape[-1] if shape else None,
        vocab=layer.num_embeddings if role == EMBEDDING else None,
        recipe=layer.recipe if role == OWN else None,
        module=layer,
    )
