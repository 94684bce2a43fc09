"""What a training step holds in memory, by kind, beside a baseline step of the same model.

:func:`memory_report` builds the step ``loss -> gradients -> optimizer update`` from a loss
function, compiles it once (no run) and reports, in bytes:

- ``parameters``: the parameters' leaves (device bytes: ``size * itemsize``);
- ``gradients``: the gradients' leaves, as ``jax.grad`` returns them;
- ``optimizer_state``: the leaves of ``optimizer.init(params)`` (0 without an optimizer);
- ``saved_activations``: the residuals autodiff keeps from the forward pass for the backward
  one (the leaves of ``jax.vjp``'s backward function that are not arguments of the loss), as
  traced, before XLA fuses anything;
- ``temporaries``: ``compiled.memory_analysis().temp_size_in_bytes`` of the compiled step: its
  peak of everything but arguments and outputs (the live part of the residuals included).

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> w = jnp.ones((64, 32)); x = jnp.ones((16, 64), jnp.bfloat16)
    >>> def loss(w, x):
    ...     y = jaxmx.dot_general(x, w, (((1,), (0,)), ((), ())))
    ...     return jnp.mean(y.astype(jnp.float32) ** 2)
    >>> r = jaxmx.diagnostics.memory_report(loss, w, x)
    >>> r.parameters, r.gradients
    (8192, 8192)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

KINDS = ("parameters", "gradients", "optimizer_state", "saved_activations", "temporaries")
"""The fields of a :class:`MemoryReport`, in its table's order."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Bytes a training step holds, by kind (:data:`KINDS`), and the same for its baseline.

    ``arguments`` and ``outputs`` are the compiled step's argument and output bytes
    (``memory_analysis``); ``baseline`` is the baseline step's report, or ``None``.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    saved_activations: int
    temporaries: int
    arguments: int
    outputs: int
    baseline: MemoryReport | None = None

    def ratios(self) -> dict[str, float]:
        """Each kind's bytes over the baseline's (``nan`` where the baseline holds none)."""
        if self.baseline is None:
            raise ValueError("MemoryReport.ratios: this report has no baseline")
        return {
            k: getattr(self, k) / b if (b := getattr(self.baseline, k)) else float("nan")
            for k in KINDS
        }

    def table(self) -> str:
        """The report as a text table in MiB, with the baseline and the ratio where there is
        one."""
        head = f"{'':<18} {'MiB':>10}"
        if self.baseline is not None:
            head += f" {'baseline MiB':>13} {'ratio':>7}"
            ratios = self.ratios()
        lines = [head]
        for k in KINDS:
            line = f"{k.replace('_', ' '):<18} {getattr(self, k) / 2**20:10.3f}"
            if self.baseline is not None:
                line += f" {getattr(self.baseline, k) / 2**20:13.3f} {ratios[k]:7.3f}"
            lines.append(line)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def memory_report(
    loss: Callable,
    params: Any,
    *args: Any,
    optimizer: Any = None,
    baseline: Callable | None = None,
    baseline_params: Any = None,
) -> MemoryReport:
    """The memory of the training step of ``loss``, by kind, beside ``baseline``'s.

    The step is ``jax.grad(loss)(params, *args)``, then with ``optimizer`` (an optax-style
    ``GradientTransformation``: ``init`` and ``update``) the update applied to the parameters
    (``params + updates`` in each parameter's dtype); it is compiled for its arguments with
    :func:`jax.jit`, not run. Call it inside :func:`jaxmx.stochastic_rounding` where the recipe
    rounds gradients stochastically.

    Args:
        loss: ``loss(params, *args) -> scalar``.
        params: a pytree of arrays: what the gradient is taken of.
        *args: the loss's other arguments (a batch), arrays or ``jax.ShapeDtypeStruct`` s.
        optimizer: ``None``, or an object with ``init(params)`` and ``update(grads, state,
            params)``, e.g. ``optax.adamw(1e-3)``.
        baseline: ``None``, or a loss of the same model to compare with (e.g. built with
            ``recipe=None``: bfloat16 GEMMs), called as ``baseline(baseline_params, *args)``
            and reported with the same ``optimizer``.
        baseline_params: the baseline's parameters; default ``params``.

    Returns:
        A :class:`MemoryReport` (``print`` it for a table).
    """
    if not callable(loss):
        raise TypeError(f"memory_report: loss must be callable, got {type(loss).__name__}")
    if baseline is not None and not callable(baseline):
        raise TypeError(
            f"memory_report: baseline must be callable or None, got {type(baseline).__name__}"
        )
    if optimizer is not None and not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise TypeError(
            "memory_report: optimizer must have init(params) and update(grads, state, params) "
            f"(an optax GradientTransformation), got {type(optimizer).__name__}"
        )
    if baseline_params is not None and baseline is None:
        raise ValueError("memory_report: baseline_params given without a baseline")
    base = None
    if baseline is not None:
        bp = params if baseline_params is None else baseline_params
        base = _report(baseline, bp, args, optimizer)
    return dataclasses.replace(_report(loss, params, args, optimizer), baseline=base)


def _report(loss: Callable, params, args: tuple, optimizer) -> MemoryReport:
    state = jax.eval_shape(optimizer.init, params) if optimizer is not None else ()

    def step(params, state, *args):
        grads = jax.grad(loss)(params, *args)
        if optimizer is None:
            return grads
        updates, state = optimizer.update(grads, state, params)
        new = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
        return new, state

    compiled = jax.jit(step).lower(params, state, *args).compile()
    m = compiled.memory_analysis()
    return MemoryReport(
        parameters=_nbytes(params),
        gradients=_nbytes(jax.eval_shape(jax.grad(loss), params, *args)),
        optimizer_state=_nbytes(state),
        saved_activations=_residual_bytes(loss, params, args),
        temporaries=m.temp_size_in_bytes,
        arguments=m.argument_size_in_bytes,
        outputs=m.output_size_in_bytes,
    )


def _residual_bytes(loss: Callable, params, args: tuple) -> int:
    """Bytes of what ``jax.vjp(loss)`` keeps for the backward pass, arguments excluded."""
    found = []

    def trace(params, *args):
        _, backward = jax.vjp(lambda p: loss(p, *args), params)
        inputs = jax.tree.leaves((params, args))
        found.extend(r for r in jax.tree.leaves(backward) if not any(r is a for a in inputs))
        return 0

    jax.make_jaxpr(trace)(params, *args)
    return sum(_leaf_bytes(r) for r in found)


def _nbytes(tree) -> int:
    return sum(_leaf_bytes(a) for a in jax.tree.leaves(tree))


def _leaf_bytes(a) -> int:
    return int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
