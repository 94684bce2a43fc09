"""In-training telemetry: the quantization statistics of every leg of every jaxmx GEMM in a step.

Inside a :func:`telemetry` block, each :func:`jaxmx.dot_general` call (and so every einsum,
attention product and Flax layer built on it), each :func:`jaxmx.ragged_dot` call and each
:func:`jaxmx.fsdp_dot_general` call (its legs those of all devices together) records, without
host callbacks:

- in the forward pass, :class:`LegStats` of its two operands as quantized for the forward GEMM
  (``lhs`` and ``rhs``, each along the contracting axis), returned by the block as arrays;
- in the backward pass, :class:`LegStats` of the output gradient's two copies (``dgrad``:
  rowwise, along the rhs free axes; ``wgrad``: columnwise, along the lhs free axes, after the
  recipe's Hadamard transform), delivered as the *gradient* of a zero "tap" that the caller
  passes in and differentiates against.

The GEMMs report the tensors they quantize themselves: the block installs its record as the
observer of :mod:`jaxmx._src.training.scope`, and each GEMM hands it its legs (the backward
ones from inside its custom VJP, as the tap's cotangent).

Inside ``jax.shard_map`` each leg is recorded for all devices together (the same value on every
device, so ``record.forward`` leaves it with ``out_specs`` ``P()``): the per-block statistics of
a leg that varies over mesh axes are all-gathered over them before they are reduced.

Outside a block nothing is recorded and nothing is added to the program.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> from jaxmx import diagnostics
    >>> dims = (((1,), (0,)), ((), ()))
    >>> def loss(w, x, taps):
    ...     with diagnostics.telemetry(taps) as tel, diagnostics.named("layer"):
    ...         y = jaxmx.dot_general(x, w, dims)
    ...     return (y**2).sum(), tel.forward
    >>> x, w = jnp.ones((32, 64)), jnp.ones((64, 32))
    >>> taps = diagnostics.gemm_taps(loss, w, x)
    >>> step = jax.jit(jax.value_and_grad(loss, (0, 2), has_aux=True))
    >>> (_, fwd), (_, grads) = step(w, x, taps)
    >>> report = diagnostics.telemetry_report(fwd, grads)
    >>> list(report), float(report["layer"].dgrad.saturated_max)
    (['layer'], 0.0)
    >>> print(diagnostics.first_nonfinite(report))
    None
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmx._src.core.explicit_axes import on_explicit_axes
from jaxmx._src.core.formats import get_format
from jaxmx._src.core.recipes import Recipe
from jaxmx._src.core.support import lacks
from jaxmx._src.core.vma import varying_axes
from jaxmx._src.diagnostics.block_stats import NAN_SCALE_EXP, BlockStats, block_stats
from jaxmx._src.training.scope import Leg, Tap, observing


class LegStats(NamedTuple):
    """Tail statistics of one quantized GEMM operand (float32 scalars; see
    :class:`jaxmx.diagnostics.BlockStats` for the per-block definitions). Blocks holding NaN or
    inf are left out of every statistic but ``nonfinite``.

    Attributes:
        span_ratio_max, span_ratio_p99: the largest and the 99th-percentile block span ratio.
        underflow_blocks: the fraction of blocks with any underflowing element.
        underflow_mean, underflow_max: the mean and largest per-block underflow fraction.
        flushed_mean, flushed_max: the mean and largest per-block fraction flushed to zero.
        saturated_max: the largest per-block fraction clipped at the format's maximum.
        sqnr_db_min: the worst block's SQNR.
        nonfinite: 1.0 if the operand held a NaN or inf, else 0.0.
    """

    span_ratio_max: jax.Array
    span_ratio_p99: jax.Array
    underflow_blocks: jax.Array
    underflow_mean: jax.Array
    underflow_max: jax.Array
    flushed_mean: jax.Array
    flushed_max: jax.Array
    saturated_max: jax.Array
    sqnr_db_min: jax.Array
    nonfinite: jax.Array


class ForwardLegs(NamedTuple):
    """What a GEMM records in the forward pass: its position among the block's GEMMs (int32)
    and the statistics of its two operands."""

    index: jax.Array
    lhs: LegStats
    rhs: LegStats


class GradientLegs(NamedTuple):
    """What a GEMM's tap receives as its gradient: the statistics of the output gradient's
    rowwise copy (dgrad) and columnwise copy (wgrad)."""

    dgrad: LegStats
    wgrad: LegStats


class GemmTelemetry(NamedTuple):
    """One GEMM's four legs (numpy values), as :func:`telemetry_report` returns them."""

    index: int
    lhs: LegStats
    rhs: LegStats
    dgrad: LegStats | None  # None: no gradient was taken
    wgrad: LegStats | None


LEGS = ("lhs", "rhs", "dgrad", "wgrad")
"""The legs in program order within a GEMM: forward operands, then the gradient's copies."""


def leg_stats(
    x: jax.Array, fmt: str, axis: int, scale_mode: str, *, where: str = "leg_stats"
) -> LegStats:
    """:class:`LegStats` of ``x`` quantized along ``axis`` (nearest rounding); an empty ``x``
    is a ValueError naming ``where``. Inside ``jax.shard_map``, an ``x`` that varies over mesh
    axes gets the statistics of the blocks of every device along them together, the same on
    every device."""
    if math.prod(np.shape(x)) == 0:
        raise ValueError(
            f"{where}: x of shape {tuple(np.shape(x))} is empty (a batch of 0 rows?): a GEMM "
            "operand without elements has no blocks to measure"
        )
    x = jax.lax.stop_gradient(x)
    return on_explicit_axes(_stats_of, x, fmt=fmt, axis=axis, scale_mode=scale_mode)


def _stats_of(x: jax.Array, fmt: str, axis: int, scale_mode: str) -> LegStats:
    s = _of_all_devices(block_stats(x, fmt, axis=axis, scale_mode=scale_mode), varying_axes(x))
    finite = s.scale_exp != NAN_SCALE_EXP  # NVFP4: every block of a tensor holding NaN or inf

    def masked(a):
        return jnp.where(finite, a.astype(jnp.float32), jnp.nan)

    span, under = masked(s.span_ratio), masked(s.underflow)
    flushed = masked(s.flushed)
    return LegStats(
        span_ratio_max=jnp.nanmax(span),
        span_ratio_p99=jnp.nanpercentile(span, 99, method="nearest"),
        underflow_blocks=jnp.nanmean(jnp.where(finite, under > 0, jnp.nan)),
        underflow_mean=jnp.nanmean(under),
        underflow_max=jnp.nanmax(under),
        flushed_mean=jnp.nanmean(flushed),
        flushed_max=jnp.nanmax(flushed),
        saturated_max=jnp.nanmax(masked(s.saturated)),
        sqnr_db_min=jnp.nanmin(masked(s.sqnr_db)),
        nonfinite=jnp.any(~finite).astype(jnp.float32),
    )


def _of_all_devices(s: BlockStats, shards: frozenset) -> BlockStats:
    """``s`` of every device's blocks together, the same on every device: inside ``shard_map``,
    the per-block statistics of an operand that varies over the mesh axes ``shards`` are
    all-gathered over them (flattened: the statistics are taken over the set of blocks).
    Outside ``shard_map`` (or for an operand the same on every device) ``s`` as it is."""
    if not shards:
        return s
    axes = tuple(sorted(shards))
    return jax.tree.map(lambda a: lax.all_gather(a.ravel(), axes, tiled=True, to="invarying"), s)


class Telemetry:
    """The record of a :func:`telemetry` block: ``forward`` maps each GEMM's name to its
    :class:`ForwardLegs` (return it from the traced function to read it).

    It is the block's :class:`~jaxmx._src.training.scope.Observer`: the GEMMs report their legs
    to it through :mod:`jaxmx._src.training.scope`, which :func:`telemetry` installs it in.
    """

    def __init__(self, taps: dict[str, GradientLegs] | None):
        self.taps = taps
        self.forward: dict[str, ForwardLegs] = {}
        self._trace = _trace_state()

    def _unique(self, name: str) -> str:
        candidates = [name] + [f"{name}#{i}" for i in range(1, len(self.forward) + 1)]
        return next(c for c in candidates if c not in self.forward)

    def forward_legs(self, name: str, recipe: Recipe, lhs: Leg, rhs: Leg) -> Tap | None:
        """Records a GEMM's forward legs under ``name`` (made unique); returns the
        :class:`~jaxmx._src.training.scope.Tap` of its backward legs when the block has taps."""
        if _trace_state() != self._trace:
            raise ValueError(
                "jaxmx.diagnostics.telemetry: a GEMM ran inside a transformation (jax.checkpoint, "
                "scan, vmap, jit, ...) nested in the telemetry block, whose values cannot leave "
                "it; enter the block inside that transformation, or call the GEMM outside it"
            )
        if any(lacks(get_format(f), "block_statistics") for f in (recipe.fwd, recipe.grad)):
            raise ValueError(
                f"jaxmx.diagnostics.telemetry covers MX and NVFP4 recipes; this GEMM's formats "
                f"are {recipe.fwd} / {recipe.grad}"
            )
        name = self._unique(name)
        discovered = _discovering.get()
        if discovered is not None:
            discovered.append(name)
        self.forward[name] = ForwardLegs(
            index=jnp.int32(len(self.forward)),
            lhs=_leg_stats(lhs, f"telemetry of GEMM {name!r}, leg lhs"),
            rhs=_leg_stats(rhs, f"telemetry of GEMM {name!r}, leg rhs"),
        )
        if self.taps is None:
            return None
        if name not in self.taps:
            raise KeyError(
                f"jaxmx.diagnostics.telemetry: no tap for GEMM {name!r}; build the taps with "
                f"gemm_taps() from the same function (they name {sorted(self.taps)})"
            )
        return Tap(self.taps[name], gradient_legs)


def _leg_stats(leg: Leg, where: str = "telemetry") -> LegStats:
    """:func:`leg_stats` of a GEMM's :class:`~jaxmx._src.training.scope.Leg`."""
    return leg_stats(leg.x, leg.fmt, leg.axis, leg.scale_mode, where=where)


def gradient_legs(dgrad: Leg, wgrad: Leg) -> GradientLegs:
    """The :class:`GradientLegs` of a GEMM's two output-gradient copies, as its backward pass
    quantizes them: what its tap receives as gradient."""
    return GradientLegs(dgrad=_leg_stats(dgrad), wgrad=_leg_stats(wgrad))


# gemm_taps: where the names of the GEMMs traced in its discovery pass go
_discovering: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "jaxmx_discovering", default=None
)


@contextlib.contextmanager
def telemetry(taps: dict[str, GradientLegs] | None = None) -> Iterator[Telemetry]:
    """Records every jaxmx GEMM called in the block (see the module docstring).

    Enter it inside the function that is jitted and differentiated (a loss function), around
    the model's call; GEMMs inside a nested ``jax.checkpoint``, ``scan``, ``vmap`` or ``jit``
    within the block are refused (their values could not leave it). The block is the calling
    thread's (and context's) only: see :mod:`jaxmx._src.training.scope`.

    Args:
        taps: ``{name: zeros}`` from :func:`gemm_taps` to record the backward legs too (take the
            gradient with respect to ``taps``), or ``None`` for the forward legs only.

    Yields:
        a :class:`Telemetry` whose ``forward`` dict is filled as the GEMMs run.
    """
    with observing(Telemetry(taps)) as record:
        yield record


def gemm_taps(fn: Callable, *args, **kwargs) -> dict[str, GradientLegs]:
    """Zero taps for every GEMM that ``fn(*args, **kwargs)`` records in a :func:`telemetry`
    block: trace ``fn`` once (abstractly, nothing runs) with ``taps=None`` passed as its last
    positional argument, and return ``{name: zeros}`` to pass in its place."""
    names: list[str] = []

    def discover(*args, **kwargs):
        token = _discovering.set(names)
        try:
            return fn(*args, None, **kwargs)
        finally:
            _discovering.reset(token)

    jax.eval_shape(lambda: discover(*args, **kwargs))  # args may be nnx modules: closed over
    zero = LegStats(*[jnp.zeros((), jnp.float32)] * len(LegStats._fields))
    return {name: GradientLegs(zero, zero) for name in names}


def _trace_state():
    """An opaque token of the current JAX trace (equal tokens: the same trace), to tell whether
    a GEMM runs in the trace its telemetry block was entered in. ``jax.extend.core`` has had
    the public ``get_opaque_trace_state`` since before JAX 0.10 (the private
    ``jax._src.core.trace_ctx`` it reads is no longer needed)."""
    return jax.extend.core.get_opaque_trace_state()


def telemetry_report(
    forward: dict[str, ForwardLegs], gradients: dict[str, GradientLegs] | None = None
) -> dict[str, GemmTelemetry]:
    """One step's telemetry as ``{name: GemmTelemetry}`` in program order, as numpy values.

    Args:
        forward: :attr:`Telemetry.forward` returned from the traced function.
        gradients: the gradient with respect to the taps of :func:`gemm_taps` (``None``: forward
            legs only).

    Raises:
        ValueError: a gradient entry names no GEMM of ``forward``.
    """
    forward = jax.device_get(forward)
    gradients = jax.device_get(gradients) if gradients is not None else {}
    unmatched = sorted(set(gradients) - set(forward))
    if unmatched:
        raise ValueError(
            f"telemetry_report: gradient entries {unmatched} match no forward GEMM (forward has "
            f"{sorted(forward)}); pass the forward record and tap gradients of the same step"
        )
    order = sorted(forward, key=lambda name: int(np.min(forward[name].index)))
    return {
        name: GemmTelemetry(
            int(np.min(forward[name].index)),
            forward[name].lhs,
            forward[name].rhs,
            *(gradients[name] if name in gradients else (None, None)),
        )
        for name in order
    }


def first_nonfinite(report: dict[str, GemmTelemetry]) -> tuple[str, str] | None:
    """``(name, leg)`` of the first leg, in program order, that held a NaN or inf, or ``None``.

    Program order: every GEMM's forward legs (``lhs``, then ``rhs``) in call order, then the
    backward legs (``dgrad``, then ``wgrad``) in reverse call order, as backpropagation runs.
    """
    forward = [(name, leg) for name in report for leg in ("lhs", "rhs")]
    backward = [(name, leg) for name in reversed(list(report)) for leg in ("dgrad", "wgrad")]
    for name, leg in forward + backward:
        stats = getattr(report[name], leg)
        if stats is not None and np.any(np.asarray(stats.nonfinite) > 0):
            return name, leg
    return None
