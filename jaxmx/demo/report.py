"""The end-of-demo summary: a loss table, the MXFP8-vs-BF16 gap and a PNG of both loss curves;
for ``--ablate``, a table of every variant's validation loss and gap to BF16.

Example:
    >>> from jaxmx.demo.report import relative_gap
    >>> round(relative_gap(2.02, 2.0), 4)
    0.01
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxmx.demo import data, diagnose
from jaxmx.demo.train import RunResult

TOLERANCE = 0.01
"""The demo's target: MXFP8's final validation loss within 1% (relative) of BF16's."""


@dataclasses.dataclass
class Summary:
    """What :func:`write` produced."""

    text: str
    val_gap: float  # relative gap of the final validation loss, MXFP8 vs BF16
    time_ratio: float  # step time MXFP8 / BF16 (RunResult.step_time)
    unigram: float  # unigram entropy of the validation bytes (nats/byte)
    plot: Path
    files: list[Path]
    inside_band: bool | None = None  # MX validation loss within the BF16 seeds' [min, max]


def write(
    runs: tuple[RunResult, RunResult],
    out: str | Path,
    *,
    config=None,
    recipe=None,
    band: list[RunResult] = (),
):
    """Writes ``summary.txt``, ``history.json`` and ``loss_curves.png`` to ``out``; with
    ``band`` (BF16 reruns with other seeds), the seed band and whether the MX run lies in it;
    with telemetry in the MX run, ``diagnostics_{name}.png`` and its summary."""
    baseline, candidate = runs
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    unigram = data.unigram_entropy(data.load_splits()[1])
    gap = relative_gap(candidate.final_val, baseline.final_val)
    verdict = "within" if abs(gap) <= TOLERANCE else "NOT within"
    text = "\n".join(
        [
            table(baseline, candidate, unigram),
            f"{candidate.name} validation loss is {verdict} {100 * TOLERANCE:.0f}% of "
            f"{baseline.name}'s ({100 * gap:+.2f}%); best model vs unigram: "
            f"{min(baseline.final_val, candidate.final_val) - unigram:+.3f} nats/byte",
        ]
    )
    inside = None
    if band:
        band_text, inside = seed_band_text([baseline, *band], candidate)
        text += "\n" + band_text
    files = []
    if candidate.telemetry:
        files.append(
            diagnose.heatmaps(
                candidate.telemetry,
                out / f"diagnostics_{candidate.name}.png",
                f"{candidate.name}: quantization telemetry per GEMM and leg",
            )
        )
        text += "\n" + diagnose.describe(candidate.telemetry, candidate.first_nonfinite)
    summary_path = out / "summary.txt"
    summary_path.write_text(text + "\n")
    history = {
        "config": dataclasses.asdict(config) if config is not None else None,
        "recipe": repr(recipe),
        "unigram_entropy": unigram,
        "runs": {r.name: r.to_dict() for r in (*runs, *band)},
    }
    history_path = out / "history.json"
    history_path.write_text(json.dumps(history, indent=1))
    png = plot(list(runs), out / "loss_curves.png", unigram=unigram)
    ratio = candidate.step_time / baseline.step_time
    files = [png, summary_path, history_path, *files]
    text += "\nwrote " + ", ".join(str(f) for f in files)
    return Summary(text, gap, ratio, unigram, png, files, inside)


def seed_band_text(baselines: list[RunResult], candidate: RunResult) -> tuple[str, bool]:
    """(a line on the BF16 seeds' validation-loss spread and where ``candidate`` lies, whether
    it lies inside ``[min, max]`` of the seeds)."""
    vals = np.array([r.final_val for r in baselines])
    inside = bool(vals.min() <= candidate.final_val <= vals.max())
    return (
        f"{baselines[0].name} over {len(vals)} seeds: validation loss {vals.mean():.4f} +- "
        f"{vals.std(ddof=1):.4f} (min {vals.min():.4f}, max {vals.max():.4f}); "
        f"{candidate.name} {candidate.final_val:.4f} is {'inside' if inside else 'outside'} "
        "the band",
        inside,
    )


def relative_gap(value: float, reference: float) -> float:
    """(value - reference) / reference: +0.01 means 1% worse than the reference."""
    return (value - reference) / reference


def table(baseline: RunResult, candidate: RunResult, unigram: float) -> str:
    """A plain-text table of final losses (nats/byte), gaps and timings of the two runs, with a
    note on what each timing measures."""
    rows = [
        ("", baseline.name, candidate.name, "rel. gap"),
        _loss_row("train loss (last 10%)", baseline.final_train, candidate.final_train),
        _loss_row("validation loss", baseline.final_val, candidate.final_val),
        (
            "step time (ms) [a]",
            f"{1e3 * baseline.step_time:.1f}",
            f"{1e3 * candidate.step_time:.1f}",
            f"x{candidate.step_time / baseline.step_time:.2f}",
        ),
        (
            "first step (compile, s) [b]",
            f"{baseline.compile_time:.1f}",
            f"{candidate.compile_time:.1f}",
            "",
        ),
        ("wall time (s) [c]", f"{baseline.wall_time:.1f}", f"{candidate.wall_time:.1f}", ""),
    ]
    if baseline.bench_step_time is not None and candidate.bench_step_time is not None:
        step_time = "both runs' compiled steps timed side by side after training (best round)"
    else:
        step_time = "the median of the run's steps after the first"
    lines = _columns(rows)
    lines += [
        f"unigram entropy of the validation bytes: {unigram:.3f} nats/byte",
        f"[a] {step_time}; x: {candidate.name} / {baseline.name}",
        "[b] the run's first step, compilation included",
        f"[c] the whole run: data, model, compilation, {len(baseline.train_loss)} steps at the "
        f"pace they ran, {len(baseline.val_loss)} validations",
    ]
    return "\n".join(lines)


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    """``rows`` as aligned text lines (the first column left-aligned), a rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def ablation_table(runs: list[RunResult]) -> str:
    """Each run's final validation loss and its relative gap to ``runs[0]`` (BF16).

    Example:
        >>> runs = [RunResult("bf16", val_loss=[2.0]), RunResult("nvfp4", val_loss=[2.03])]
        >>> print(ablation_table(runs))
        variant  validation loss  gap to bf16
        -------------------------------------
        bf16              2.0000
        nvfp4             2.0300       +1.50%
    """
    base = runs[0]
    rows = [("variant", "validation loss", f"gap to {base.name}")]
    for i, run in enumerate(runs):
        gap = f"{100 * relative_gap(run.final_val, base.final_val):+.2f}%" if i else ""
        rows.append((run.name, f"{run.final_val:.4f}", gap))
    return "\n".join(_columns(rows))


def write_ablation(runs: list[RunResult], out: str | Path, *, config=None, recipe=None) -> str:
    """Writes ``summary.txt`` (:func:`ablation_table`), ``history.json`` (the table as
    ``ablation``, and every run's losses) and ``loss_curves.png`` to ``out``; returns the text."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = runs[0]
    text = ablation_table(runs)
    (out / "summary.txt").write_text(text + "\n")
    history = {
        "config": dataclasses.asdict(config) if config is not None else None,
        "recipe": repr(recipe),
        "ablation": [
            {
                "variant": r.name,
                "val_loss": r.final_val,
                "val_gap": relative_gap(r.final_val, base.final_val),
            }
            for r in runs
        ],
        "runs": {r.name: r.to_dict() for r in runs},
    }
    (out / "history.json").write_text(json.dumps(history, indent=1))
    png = plot(runs, out / "loss_curves.png", unigram=data.unigram_entropy(data.load_splits()[1]))
    files = [png, out / "summary.txt", out / "history.json"]
    return text + "\nwrote " + ", ".join(str(f) for f in files)


def _loss_row(label: str, base: float, cand: float) -> tuple[str, str, str, str]:
    return (label, f"{base:.4f}", f"{cand:.4f}", f"{100 * relative_gap(cand, base):+.2f}%")


def plot(runs: list[RunResult], path: str | Path, unigram: float | None = None) -> Path:
    """Writes the loss curves of ``runs`` (and the gap of the later ones to the first) as a PNG.

    Top: smoothed training loss and validation loss per run. Bottom: relative gap of each later
    run to ``runs[0]``, training (smoothed) and validation.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax, gap_ax) = plt.subplots(
        2, 1, figsize=(7, 6), dpi=110, sharex=True, gridspec_kw={"height_ratios": [3, 1.3]}
    )
    base = runs[0]
    for i, run in enumerate(runs):
        color = f"C{i}"
        ax.plot(run.steps, smooth(run.train_loss), color=color, lw=1.2, label=f"{run.name} train")
        ax.plot(run.val_steps, run.val_loss, "o--", color=color, ms=4, label=f"{run.name} val")
        if i and run.steps == base.steps:
            train_gap = 100 * (smooth(run.train_loss) / smooth(base.train_loss) - 1)
            gap_ax.plot(run.steps, train_gap, color=color, lw=1, label=f"{run.name} train")
        if i and run.val_steps == base.val_steps:
            val_gap = 100 * (np.array(run.val_loss) / np.array(base.val_loss) - 1)
            gap_ax.plot(run.val_steps, val_gap, "o--", color=color, ms=4, label=f"{run.name} val")
    if unigram is not None:
        ax.axhline(unigram, color="gray", lw=0.8, ls=":", label="unigram entropy")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title("jaxmx demo: byte-level transformer on pydoc topics")
    ax.grid(alpha=0.3)
    ax.legend()
    gap_ax.axhline(0, color="gray", lw=0.8)
    for bound in (-100 * TOLERANCE, 100 * TOLERANCE):
        gap_ax.axhline(bound, color="gray", lw=0.8, ls=":")
    gap_ax.set_ylabel(f"vs {base.name} (%)")
    gap_ax.set_xlabel("step")
    gap_ax.grid(alpha=0.3)
    if len(runs) > 1:
        gap_ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def smooth(values: list[float], window: int = 20) -> np.ndarray:
    """Trailing moving average (over fewer points at the start), same length as ``values``."""
    v = np.asarray(values, dtype=np.float64)
    c = np.concatenate([[0.0], np.cumsum(v)])
    i = np.arange(1, len(v) + 1)
    lo = np.maximum(i - window, 0)
    return (c[i] - c[lo]) / (i - lo)
