"""The trace-time state that the training GEMMs read, held in ``contextvars``.

Three pieces of state reach :func:`jaxmx.dot_general` (and every GEMM built on it, and
:func:`jaxmx.ragged_dot` and :func:`jaxmx.fsdp_dot_general`) from the code around the call
rather than from its arguments:

- the stochastic-rounding key source of :func:`stochastic_rounding`;
- the GEMM names of :func:`named` blocks (``/``-joined, for telemetry);
- the active :class:`Observer` (installed by :func:`observing`: ``jaxmx.diagnostics.telemetry``
  is one), to which every GEMM reports the operands it quantizes (its "legs").

Each is a :class:`contextvars.ContextVar` holding an immutable value, so each thread sees only
its own blocks, and a context copied with :func:`contextvars.copy_context` keeps the state it
had when it was copied. The training GEMMs read this module only; they never import the
diagnostics that observe them.

Keys: layers (Flax or not) call :func:`jaxmx.dot_general` without a ``key``. Inside
``with jaxmx.stochastic_rounding(key):`` each call that needs a key and was given none gets
``fold_in(key, i)``, with ``i`` counting those calls in trace order, so every GEMM draws
different rounding noise. Enter the block inside the function you ``jit`` (the key is a traced
value) and pass a fresh key each step.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> recipe = jaxmx.recipes.MXFP8.replace(grad_rounding="stochastic")
    >>> def loss(w, x, key):
    ...     with jaxmx.stochastic_rounding(key):
    ...         return jaxmx.dot_general(x, w, (((1,), (1,)), ((), ())), recipe=recipe).sum()
    >>> g = jax.jit(jax.grad(loss))(jnp.ones((4, 32)), jnp.ones((8, 32)), jax.random.key(0))
    >>> g.shape
    (4, 32)
    >>> with named("block0"), named("mlp"):
    ...     gemm_name()
    'block0/mlp'
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import jax

from jaxmx._src.core.explicit_axes import on_context_mesh
from jaxmx._src.core.recipes import Recipe

__all__ = [
    "Leg",
    "Observer",
    "Tap",
    "copy_keys",
    "gemm_name",
    "gradient_key",
    "named",
    "next_key",
    "observe",
    "observer",
    "observing",
    "require_gradient_key",
    "stochastic_rounding",
]


# --- stochastic-rounding keys ---------------------------------------------------------------


class _Source(NamedTuple):
    key: jax.Array
    count: int = 0  # keys handed out so far


_source: contextvars.ContextVar[_Source | None] = contextvars.ContextVar(
    "jaxmx_stochastic_rounding", default=None
)


@contextlib.contextmanager
def stochastic_rounding(key: jax.Array) -> Iterator[None]:
    """Supplies ``fold_in(key, i)`` to the i-th keyless stochastic-rounding GEMM in the block.

    A GEMM inside a ``lax.scan`` / ``nnx.scan`` body is traced once, so all iterations share its
    key: to vary it, enter the block inside the body with ``fold_in(key, step_index)``.
    """
    token = _source.set(_Source(key))
    try:
        yield
    finally:
        _source.reset(token)


def next_key() -> jax.Array | None:
    """The next key of the innermost :func:`stochastic_rounding` block, or ``None`` outside."""
    source = _source.get()
    if source is None:
        return None
    _source.set(source._replace(count=source.count + 1))
    return jax.random.fold_in(source.key, source.count)


def gradient_key(grad_rounding: str, key: jax.Array | None) -> jax.Array | None:
    """The key a GEMM's gradient rounds with: none for ``"nearest"``, else ``key`` or the next key
    of an enclosing :func:`stochastic_rounding` block (``None`` outside one: only taking a
    gradient needs it, see :func:`require_gradient_key`)."""
    if grad_rounding == "nearest":
        return None
    return next_key() if key is None else key


def require_gradient_key(grad_rounding: str, key: jax.Array | None) -> None:
    """Raises the ValueError that says how to supply a key, when a gradient needs one."""
    if grad_rounding == "stochastic" and key is None:
        raise ValueError(
            "recipe.grad_rounding='stochastic' needs a PRNG key to round the gradient: pass "
            "key=..., or call inside `with jaxmx.stochastic_rounding(key):`"
        )


def copy_keys(key: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
    """The keys of the output gradient's rowwise and columnwise copies: ``fold_in(key, 0)`` and
    ``fold_in(key, 1)`` (``None`` for both without a key)."""
    if key is None:
        return None, None
    return jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)


# --- GEMM names -----------------------------------------------------------------------------

_names: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "jaxmx_gemm_names", default=()
)


@contextlib.contextmanager
def named(name: str) -> Iterator[None]:
    """Names the jaxmx GEMMs called in the block for :func:`jaxmx.diagnostics.telemetry`
    (nested names join with ``/``; the observer numbers a name used twice ``#1``, ``#2``, ...).
    GEMMs outside any ``named`` block are called ``dot_general`` (``ragged_dot`` for
    :func:`jaxmx.ragged_dot`, ``fsdp_dot_general`` for :func:`jaxmx.fsdp_dot_general`). The
    Flax layers name theirs by module path.

    Example:
        >>> with named("attn"), named("qk"):
        ...     gemm_name()
        'attn/qk'
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"named: a GEMM name must be a non-empty str, got {name!r}")
    token = _names.set((*_names.get(), name))
    try:
        yield
    finally:
        _names.reset(token)


def gemm_name(default: str = "dot_general") -> str:
    """The ``/``-joined names of the enclosing :func:`named` blocks, or ``default`` outside.

    Example:
        >>> gemm_name(), gemm_name("ragged_dot")
        ('dot_general', 'ragged_dot')
    """
    return "/".join(_names.get()) or default


# --- the observer of the GEMMs' legs --------------------------------------------------------


class Leg(NamedTuple):
    """One GEMM operand as the GEMM quantizes it: the high-precision tensor ``x`` (the very
    array that is quantized, e.g. the output gradient after the recipe's Hadamard transform),
    its format and scale rule, and the axis its blocks run along.

    Example:
        >>> import jax.numpy as jnp
        >>> Leg(jnp.ones((4, 64)), "mxfp8_e4m3", -1, "rceil").axis
        -1
    """

    x: jax.Array
    fmt: str
    axis: int
    scale_mode: str


class Tap(NamedTuple):
    """What an observer returns for a GEMM whose backward legs it records: ``value``, a pytree
    the GEMM takes as an extra differentiable input (and otherwise ignores), and ``backward``,
    a hashable function ``backward(dgrad: Leg, wgrad: Leg)`` whose result the GEMM's backward
    pass returns as ``value``'s cotangent (so the caller reads it as a gradient)."""

    value: Any
    backward: Callable[[Leg, Leg], Any]


class Observer(Protocol):
    """What :func:`observing` installs: told of each GEMM's forward legs, at trace time."""

    def forward_legs(self, name: str, recipe: Recipe, lhs: Leg, rhs: Leg) -> Tap | None:
        """Records GEMM ``name``'s forward operands; returns a :class:`Tap` to also receive its
        backward legs, or ``None``."""


_observer: contextvars.ContextVar[Observer | None] = contextvars.ContextVar(
    "jaxmx_observer", default=None
)


@contextlib.contextmanager
def observing(obs: Observer) -> Iterator[Observer]:
    """Makes ``obs`` the observer of the jaxmx GEMMs called in the block (the innermost block's
    observer wins).

    Example:
        >>> class Names:
        ...     def __init__(self): self.seen = []
        ...     def forward_legs(self, name, recipe, lhs, rhs): self.seen.append(name)
        >>> import jax.numpy as jnp, jaxmx
        >>> dims = (((1,), (1,)), ((), ()))
        >>> with observing(Names()) as obs, named("proj"):
        ...     _ = jaxmx.dot_general(jnp.ones((4, 32)), jnp.ones((8, 32)), dims)
        >>> obs.seen
        ['proj']
    """
    token = _observer.set(obs)
    try:
        yield obs
    finally:
        _observer.reset(token)


def observer() -> Observer | None:
    """The active :class:`Observer`, or ``None`` outside any :func:`observing` block."""
    return _observer.get()


def observe(recipe: Recipe, lhs: Leg, rhs: Leg, default_name: str = "dot_general") -> Tap | None:
    """Reports a GEMM's forward legs to the active observer, under the current
    :func:`gemm_name`; returns its :class:`Tap`, or ``None`` (no observer, or it records no
    backward legs for this GEMM). Outside an :func:`observing` block this adds nothing to the
    program. The tap's value is typed on the GEMM's mesh (:func:`on_context_mesh`: a GEMM on
    Explicit mesh axes runs with them switched to Auto), so its cotangent matches its type."""
    obs = _observer.get()
    if obs is None:
        return None
    tap = obs.forward_legs(gemm_name(default_name), recipe, lhs, rhs)
    return None if tap is None else tap._replace(value=on_context_mesh(tap.value))
