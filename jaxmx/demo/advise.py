"""``--advise``: which scaling granularity each GEMM leg of the demo model needs, and a run
trained with the advised per-layer recipes beside uniform MXFP8.

After a short MXFP8 training, :func:`jaxmx.diagnostics.advise` measures every leg of one step
(a fresh batch); the advice becomes a ``{layer path: Recipe}`` mapping for ``quantize_model``,
and a model trained with it from the same seed on the same batches is compared with the MXFP8
run.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

import jaxmx
from jaxmx import diagnostics
from jaxmx.demo import data
from jaxmx.demo.losses import loss_fn


def advise_model(model, cfg, budget: float) -> diagnostics.Advice:
    """The advice for ``model`` on the first batch of the data order of seed ``cfg.seed + 1``."""
    train_data, _ = data.load_splits()
    x, y = (
        jnp.asarray(a)
        for a in next(data.batches(train_data, cfg.batch, cfg.seq_len, seed=cfg.seed + 1))
    )
    return diagnostics.advise(loss_fn, model, x, y, underflow_budget=budget)


def _level_index(g) -> float:
    """The index of a leg's level in the ladder; NaN (blank) for a leg holding NaN or inf."""
    level = g.recommendation.level
    return np.nan if level is None else diagnostics.LEVELS.index(level)


def plot(advice: diagnostics.Advice, path: str | Path) -> Path:
    """A PNG: layer x leg, colored by the level each leg needs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(advice)
    legs = diagnostics.LEGS
    values = np.array(
        [
            [_level_index(advice[n].legs[leg]) if leg in advice[n].legs else np.nan for leg in legs]
            for n in names
        ]
    )
    fig, ax = plt.subplots(figsize=(6, 0.35 * len(names) + 2), dpi=100)
    image = ax.imshow(
        values,
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        vmin=0,
        vmax=len(diagnostics.LEVELS) - 1,
    )
    ax.set_xticks(range(len(legs)))
    ax.set_xticklabels(legs)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=7)
    bar = fig.colorbar(image, ax=ax, ticks=range(len(diagnostics.LEVELS)))
    bar.ax.set_yticklabels(diagnostics.LEVELS)
    ax.set_title(f"coarsest scaling within {100 * advice.underflow_budget:.3g}% underflow")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def report(advice, mapping: dict, mxfp8_run, advised_run) -> str:
    """The advice table, the mapping and the two runs' final losses."""
    lines = [str(advice), "advised recipes:"]
    lines += [f"  {path}: {_name(recipe)}" for path, recipe in mapping.items()]
    lines.append("final losses (the progress lines above show one step's batch loss):")
    for run in (mxfp8_run, advised_run):
        lines.append(
            f"  {run.name:8s} train (mean of the last 10% of steps) {run.final_train:.4f}  "
            f"validation (after the last step) {run.final_val:.4f}"
        )
    return "\n".join(lines)


def _name(recipe) -> str:
    """A preset's name (``jaxmx.recipes``), else the recipe's formats and weight tile."""
    for name in jaxmx.recipes.__all__:
        if getattr(jaxmx.recipes, name) == recipe:
            return name
    return f"Recipe({recipe.fwd} / {recipe.grad}, weight_tile={recipe.weight_tile})"


def write(text: str, advice, out: str | Path) -> Path:
    """Writes ``advise.txt`` and ``granularity.png`` to ``out``; returns the plot's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "advise.txt").write_text(text + "\n")
    return plot(advice, out / "granularity.png")
