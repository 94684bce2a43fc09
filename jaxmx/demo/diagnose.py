"""``--diagnose``: per-layer quantization telemetry over training, as heat maps (GEMM x step).

Every ``every`` steps the training step runs with :func:`jaxmx.diagnostics.telemetry` on: the
same update, plus the statistics of all four legs of every jaxmx GEMM (forward lhs and rhs, the
gradient's dgrad and wgrad copies). :func:`heatmaps` draws two statistics per leg: the fraction
of blocks with an underflowing element, and the largest block span ratio (log2).

Example:
    >>> history = {10: {"blocks/0/mlp/up": {"lhs": {"underflow_blocks": 0.5}}}}
    >>> matrix(history, "lhs", "underflow_blocks")
    (['blocks/0/mlp/up'], [10], array([[0.5]]))
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flax import nnx

from jaxmx import diagnostics
from jaxmx.demo.losses import loss_fn, rounding

METRICS = ("underflow_blocks", "span_ratio_max")
"""The statistics drawn per leg (see :class:`jaxmx.diagnostics.LegStats`)."""


def diagnosed_loss(model, inputs, targets, taps):
    with diagnostics.telemetry(taps) as record:
        loss = loss_fn(model, inputs, targets)
    return loss, record.forward


@nnx.jit
def diagnosed_train_step(model, optimizer, inputs, targets, taps, key=None):
    """:func:`jaxmx.demo.train.train_step` that also returns the step's telemetry."""
    grad_fn = nnx.value_and_grad(diagnosed_loss, argnums=(0, 3), has_aux=True)
    with rounding(key):
        (loss, forward), (grads, tap_grads) = grad_fn(model, inputs, targets, taps)
    optimizer.update(model, grads)
    return loss, forward, tap_grads


def taps_for(model, inputs, targets):
    """Zero gradient taps for every jaxmx GEMM of ``model``'s loss."""
    return diagnostics.gemm_taps(diagnosed_loss, model, inputs, targets)


def as_plain(report: dict[str, diagnostics.GemmTelemetry]) -> dict:
    """``{gemm: {leg: {statistic: float}}}``: one step's report as JSON-able values."""
    return {
        name: {
            leg: {k: float(v) for k, v in getattr(gemm, leg)._asdict().items()}
            for leg in diagnostics.LEGS
            if getattr(gemm, leg) is not None
        }
        for name, gemm in report.items()
    }


def matrix(history: dict[int, dict], leg: str, metric: str):
    """(GEMM names, steps, values [gemm, step]) of one statistic of one leg over training."""
    steps = sorted(history)
    names = list(history[steps[0]])
    values = np.array(
        [[history[s][n].get(leg, {}).get(metric, np.nan) for s in steps] for n in names]
    )
    return names, steps, values


def heatmaps(history: dict[int, dict], path: str | Path, title: str) -> Path:
    """A PNG of GEMM x step heat maps: one row per :data:`METRICS` entry, one column per leg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, steps, _ = matrix(history, "lhs", METRICS[0])
    fig, axes = plt.subplots(
        len(METRICS),
        len(diagnostics.LEGS),
        figsize=(3.2 * len(diagnostics.LEGS), 0.35 * len(names) * len(METRICS) + 2.5),
        dpi=100,
        sharey=True,
        squeeze=False,
    )
    for row, metric in enumerate(METRICS):
        for col, leg in enumerate(diagnostics.LEGS):
            _, _, values = matrix(history, leg, metric)
            if metric == "span_ratio_max":  # all-zero blocks (span 0) left blank
                values = np.log2(np.where(values > 0, values, np.nan))
            ax = axes[row, col]
            image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis")
            ax.set_title(
                f"{leg}: {'log2 ' if metric == 'span_ratio_max' else ''}{metric}", fontsize=9
            )
            ax.set_xticks(range(len(steps))[:: max(1, len(steps) // 6)])
            ax.set_xticklabels(steps[:: max(1, len(steps) // 6)], fontsize=7)
            ax.set_yticks(range(len(names)))
            ax.set_yticklabels(names, fontsize=7)
            fig.colorbar(image, ax=ax, fraction=0.046)
        axes[row, 0].set_ylabel("GEMM")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def describe(history: dict[int, dict], first_nonfinite: tuple | None) -> str:
    """A few lines: per statistic, the worst GEMM and leg over training, and the first NaN/inf
    (``(step, gemm, leg)`` or ``None``)."""
    lines = [f"telemetry at {len(history)} steps ({min(history)} .. {max(history)}):"]
    for metric in METRICS:
        value, name, leg, step = max(
            (
                (history[s][n][leg][metric], n, leg, s)
                for s in history
                for n in history[s]
                for leg in history[s][n]
            ),
            key=lambda t: np.nan_to_num(t[0], nan=-np.inf),
        )
        lines.append(f"  largest {metric}: {value:.3g} ({name} {leg}, step {step})")
    if first_nonfinite is None:
        lines.append("  no NaN/inf in any leg")
    else:
        step, name, leg = first_nonfinite
        lines.append(f"  first NaN/inf: step {step}, {name} {leg}")
    return "\n".join(lines)
