"""The advisor in training: :func:`advise` measures every GEMM leg of one training step at
every scaling level, through an observer of the step's GEMMs (as telemetry is one).

See :func:`advise` for an example.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from jaxmx._src.core.checks import normalize_axis
from jaxmx._src.core.explicit_axes import on_context_mesh, on_explicit_axes
from jaxmx._src.core.formats import Format
from jaxmx._src.core.recipes import Recipe
from jaxmx._src.diagnostics.advice import Advice, LayerAdvice
from jaxmx._src.diagnostics.granularity import Granularity, check_budget
from jaxmx._src.diagnostics.level_stats import measure
from jaxmx._src.diagnostics.levels import (
    checked_levels,
    element_of,
    ladder,
    levels_named,
    span_limit,
)
from jaxmx._src.diagnostics.telemetry import LEGS
from jaxmx._src.training.scope import Leg, Tap, observing


def _leg_levels(levels: tuple[str, ...], element: str, leg: str) -> tuple[str, ...]:
    """The levels measured on a leg: tiled levels (``"128x128"``) for the weight (``rhs``)
    only."""
    if leg == "rhs":
        return levels
    return tuple(level.name for level in levels_named(element, levels) if level.tile is None)


def _leg_tensor(leg: Leg) -> jax.Array:
    """The tensor a leg quantizes, float32, out of the gradient."""
    return jax.lax.stop_gradient(leg.x).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _GradientLegs:
    """A GEMM's backward hook (hashable): the output gradient's two copies, as tensors; with
    ``sizes``, instead records their shapes and axes there under ``name`` and returns the
    scalar tap's zero cotangent (the abstract pass that sizes the taps)."""

    sizes: dict | None = dataclasses.field(default=None, hash=False, compare=False)
    name: str = ""

    def __call__(self, dgrad: Leg, wgrad: Leg):
        legs = {"dgrad": dgrad, "wgrad": wgrad}
        if self.sizes is None:
            return {leg: _leg_tensor(g) for leg, g in legs.items()}
        self.sizes[self.name] = {leg: (g.x.shape, g.axis) for leg, g in legs.items()}
        return jnp.zeros((), jnp.float32)


class _Advisor:
    """The observer of :func:`advise`: each GEMM's forward legs kept as tensors (and their
    axes), its backward legs through its tap (see :mod:`jaxmx._src.training.scope`): with
    ``sizes``, a scalar tap per GEMM whose backward records the legs' shapes there; else each
    GEMM of ``taps`` gets its tap, zeros shaped like its backward legs."""

    def __init__(self, taps: dict | None, sizes: dict | None = None):
        self.taps, self.sizes = taps, sizes
        self.forward: dict[str, dict[str, jax.Array]] = {}
        self.axes: dict[str, dict[str, int]] = {}
        self._trace = jax.extend.core.get_opaque_trace_state()

    def forward_legs(self, name: str, recipe: Recipe, lhs: Leg, rhs: Leg) -> Tap | None:
        if jax.extend.core.get_opaque_trace_state() != self._trace:
            raise ValueError(
                "jaxmx.diagnostics.advise: a GEMM ran inside a transformation (jax.checkpoint, "
                "scan, vmap, jit, ...) nested in the step, whose values cannot leave it; call "
                "advise on a step without it"
            )
        name = next(
            c
            for c in [name] + [f"{name}#{i}" for i in range(1, len(self.forward) + 2)]
            if c not in self.forward
        )
        self.forward[name] = {"lhs": _leg_tensor(lhs), "rhs": _leg_tensor(rhs)}
        self.axes[name] = {"lhs": lhs.axis, "rhs": rhs.axis}
        if self.taps is None or name not in self.taps:
            return None
        if self.sizes is not None:
            return Tap(self.taps[name], _GradientLegs(self.sizes, name))
        return Tap(self.taps[name], _GradientLegs())


def advise(
    fn: Callable,
    *args,
    fmt: str | Format = "fp8_e4m3",
    levels: tuple[str, ...] | None = None,
    underflow_budget: float = 1e-3,
    **kwargs,
) -> Advice:
    """Measures every GEMM leg of one training step at every scaling level: the forward
    operands (``lhs`` along K, ``rhs`` the weight along K) and the output gradient's copies
    (``dgrad`` along N, ``wgrad`` along M), as :func:`jaxmx.diagnostics.granularity` does for
    one tensor.

    ``fn(*args, **kwargs)`` computes a scalar loss with jaxmx GEMMs (:func:`jaxmx.dot_general`
    and what is built on it: the layers of a model converted by ``quantize_model`` are named by
    module path, other GEMMs by :func:`jaxmx.diagnostics.named`). It is traced abstractly twice
    (to find the GEMMs, then the shapes of their gradient legs) and run once under ``jax.jit``
    with the gradient taken, keeping every leg; each leg is then measured by
    :func:`jaxmx.diagnostics.granularity`'s compiled program, one per padded shape
    (:func:`~jaxmx._src.diagnostics.level_stats.measure`; no host callbacks). The GEMMs run
    in their own recipes; the legs are measured in ``fmt`` whatever those are.

    Args:
        fn: the loss function of ``args`` and ``kwargs`` (arrays, Flax nnx modules, any pytree):
            their array leaves enter the step's ``jax.jit`` as arguments (arrays ``fn`` closes
            over itself become constants of the program, which XLA folds while compiling:
            pass them in ``args``), the other leaves as they are.
        fmt: the element format measured (as for :func:`jaxmx.diagnostics.granularity`).
        levels: the levels measured (as for :func:`jaxmx.diagnostics.granularity`; ``None``:
            all the format has).
            Tiled levels (``"128x128"``) are measured on the weight (``rhs``) only:
            activations and gradients are not tiled.
        underflow_budget: the largest underflow fraction a level may leave, in [0, 1].

    Returns:
        an :class:`Advice` (its ``loss``: the step's loss).

    Example:
        >>> import jax, jax.numpy as jnp, jaxmx
        >>> from jaxmx import diagnostics
        >>> def loss(w, x):
        ...     with diagnostics.named("proj"):
        ...         return (jaxmx.dot_general(x, w, (((1,), (0,)), ((), ()))) ** 2).sum()
        >>> x, w = jax.random.normal(jax.random.key(0), (2, 32, 64))
        >>> advice = diagnostics.advise(loss, w.T, x, underflow_budget=0.01)
        >>> advice["proj"].level, sorted(advice["proj"].legs)
        ('tensor', ['dgrad', 'lhs', 'rhs', 'wgrad'])
    """
    element = element_of(fmt)
    levels = checked_levels(levels, element, 2)
    if not _leg_levels(levels, element, "lhs"):
        raise ValueError(
            f"jaxmx.diagnostics.advise: levels={levels} measures the weights only; add a level "
            "for the activations and gradients"
        )
    check_budget(underflow_budget)
    observers: list[_Advisor] = []
    arrays, rebuild = _array_arguments((args, kwargs))

    def run(taps, arrays, sizes=None):
        observers.append(_Advisor(taps, sizes))
        step_args, step_kwargs = rebuild(arrays)
        with observing(observers[-1]):
            loss = fn(*step_args, **step_kwargs)
        return loss, observers[-1].forward

    jax.eval_shape(lambda arrays: run(None, arrays), arrays)
    names = list(observers[0].forward)
    if not names:
        raise ValueError("jaxmx.diagnostics.advise: the step ran no jaxmx GEMM; nothing to advise")
    sizes: dict[str, dict] = {}
    scalars = {name: jnp.zeros((), jnp.float32) for name in names}
    jax.eval_shape(jax.grad(lambda taps: run(taps, arrays, sizes)[0]), scalars)
    taps = {
        name: {leg: jnp.zeros(shape, jnp.float32) for leg, (shape, _) in legs.items()}
        for name, legs in sizes.items()
    }
    (loss, forward), grads = jax.jit(jax.value_and_grad(run, has_aux=True))(taps, arrays)
    # a GEMM on Explicit mesh axes runs with them switched to Auto: its forward legs come out so
    forward = on_context_mesh(forward)
    sized = observers[1]
    axes = {
        name: {
            **sized.axes[name],
            **{leg: axis for leg, (_, axis) in sizes.get(name, {}).items()},
        }
        for name in names
    }
    measured = {
        name: {
            leg: _leg_stats(x, axes[name][leg], element, levels, leg)
            for leg, x in {**forward[name], **grads.get(name, {})}.items()
        }
        for name in names
    }
    return Advice(
        {
            name: _layer_advice(name, measured[name], element, levels, underflow_budget)
            for name in names
        },
        underflow_budget=float(underflow_budget),
        loss=float(loss),
    )


def _leg_stats(x: jax.Array, axis: int, element: str, levels, leg: str):
    """A leg's :class:`LevelStats`: one compiled program per padded shape and levels, shared by
    every leg that has them (:func:`~jaxmx._src.diagnostics.level_stats.measure`)."""
    axis = normalize_axis(axis, x.ndim)
    levels = _leg_levels(levels, element, leg)
    return jax.device_get(
        on_explicit_axes(measure, x, axis=axis, levels=levels_named(element, levels))
    )


def _array_arguments(tree) -> tuple[list, Callable]:
    """The array leaves of ``tree`` (JAX and numpy arrays: the weights and data of a step) and
    the function that puts leaves in their place. The step takes them as arguments of its
    ``jax.jit``: closed over, they would be constants of the program, which XLA evaluates
    while compiling (slowly, element by element)."""
    leaves, treedef = jax.tree.flatten(tree)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array | np.ndarray)]

    def rebuild(arrays):
        filled = list(leaves)
        for i, a in zip(where, arrays, strict=True):
            filled[i] = a
        return jax.tree.unflatten(treedef, filled)

    return [leaves[i] for i in where], rebuild


def _layer_advice(name, measured, element, levels, budget) -> LayerAdvice:
    legs = {
        leg: Granularity(
            stats=tuple(measured[leg]),
            names=_leg_levels(levels, element, leg),
            element=element,
            span_limit=span_limit(element),
            underflow_budget=float(budget),
        )
        for leg in LEGS
        if leg in measured
    }
    decided = {leg: g.recommendation for leg, g in legs.items()}
    nonfinite = tuple(leg for leg, rec in decided.items() if rec.level is None)
    if nonfinite:
        reasons = "; ".join(f"{leg}: {decided[leg].reason}" for leg in nonfinite)
        return LayerAdvice(name=name, legs=legs, level=None, reason=reasons, nonfinite=nonfinite)
    every = ladder()
    leg = max(decided, key=lambda leg: every.index(decided[leg].level))
    return LayerAdvice(
        name=name, legs=legs, level=decided[leg].level, reason=f"{leg}: {decided[leg].reason}"
    )
