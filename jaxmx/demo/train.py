"""Train the demo transformer once, in BF16 or with MX / FP8 / FP4 linear layers, and record the
losses; :func:`ablate` trains a 4-bit recipe with each of its features switched off in turn.

Example:
    >>> from jaxmx.demo.train import Config, train
    >>> cfg = Config(steps=2, d_model=32, layers=1, heads=2, seq_len=32, batch=4, eval_batches=1)
    >>> run = train(cfg, recipe=None, progress=False)
    >>> run.name, len(run.train_loss)
    ('bf16', 2)
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxmx
from jaxmx import diagnostics
from jaxmx.demo import data, diagnose
from jaxmx.demo.config import FORMAT_RECIPES, RECIPES, Config
from jaxmx.demo.losses import loss_fn, rounding
from jaxmx.demo.model import Transformer
from jaxmx.flax import MXAttention
from jaxmx.flax.nnx import quantize_model


@dataclasses.dataclass
class RunResult:
    """Losses (nats/byte) and timings of one training run."""

    name: str
    steps: list[int] = dataclasses.field(default_factory=list)  # 1-based step of each train loss
    train_loss: list[float] = dataclasses.field(default_factory=list)
    val_steps: list[int] = dataclasses.field(default_factory=list)
    val_loss: list[float] = dataclasses.field(default_factory=list)
    step_times: list[float] = dataclasses.field(default_factory=list)  # seconds, excluding step 1
    compile_time: float = 0.0  # first step, compilation included
    wall_time: float = 0.0  # the whole run: build, compile, train, evaluate
    bench_step_time: float | None = None  # seconds per step, timed interleaved (see benchmark)
    telemetry: dict[int, dict] = dataclasses.field(
        default_factory=dict
    )  # step -> diagnose.as_plain
    first_nonfinite: tuple[int, str, str] | None = None  # (step, GEMM, leg) of the first NaN/inf
    model: Transformer | None = dataclasses.field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        """The losses and timings (not the model) as plain JSON-able values."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}
        d.update(final_train=self.final_train, final_val=self.final_val, step_time=self.step_time)
        return d

    @property
    def final_train(self) -> float:
        """Mean training loss over the last 10% of steps (smooths batch noise)."""
        n = max(1, len(self.train_loss) // 10)
        return float(np.mean(self.train_loss[-n:]))

    @property
    def final_val(self) -> float:
        """Validation loss after the last step."""
        return self.val_loss[-1]

    @property
    def step_time(self) -> float:
        """Seconds per training step: the interleaved benchmark if run, else the training median."""
        if self.bench_step_time is not None:
            return self.bench_step_time
        return float(np.median(self.step_times)) if self.step_times else float("nan")


def build_model(cfg: Config, recipe=None, attention: bool = False) -> Transformer:
    """The demo model; with a recipe, its linear layers (not embed/head) go through jaxmx, except
    those of the last ``cfg.keep_last`` blocks (kept in BF16), and with ``attention`` its
    attention products (``QK^T``, ``PV``) too."""
    model = Transformer(
        data.VOCAB,
        cfg.d_model,
        cfg.layers,
        cfg.heads,
        cfg.seq_len,
        rngs=nnx.Rngs(cfg.seed),
        save_fmt=cfg.save_activations,
    )
    if recipe is not None:
        quantize_model(model, recipe, keep_last=cfg.keep_last)
        if attention:
            for block in list(model.blocks)[: cfg.layers - cfg.keep_last]:
                block.attn.attention_fn = MXAttention(recipe)
    return model


@nnx.jit
def train_step(model, optimizer, inputs, targets, key=None):
    """One AdamW step; ``key``: the step's stochastic-rounding key (:func:`step_key`), if any."""
    with rounding(key):
        loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
    optimizer.update(model, grads)
    return loss


def step_key(cfg: Config, recipe, step: int) -> jax.Array | None:
    """The key of step ``step``'s stochastic gradient rounding, ``fold_in(key(cfg.seed), step)``;
    ``None`` when ``recipe`` rounds to nearest (or is BF16), which leaves the step's program as
    it was; ``recipe`` may be a per-layer mapping ``{path: Recipe}``.

    Example:
        >>> import jaxmx
        >>> step_key(Config(), jaxmx.recipes.MXFP8, 1) is None
        True
        >>> step_key(Config(), jaxmx.recipes.NVFP4, 1).shape
        ()
    """
    recipes = recipe.values() if isinstance(recipe, Mapping) else [recipe]  # per-layer recipes
    if not any(r is not None and r.grad_rounding == "stochastic" for r in recipes):
        return None
    return jax.random.fold_in(jax.random.key(cfg.seed), step)


@nnx.jit
def eval_step(model, inputs, targets):
    return loss_fn(model, inputs, targets)


def evaluate(model, batches) -> float:
    return float(np.mean([float(eval_step(model, x, y)) for x, y in batches]))


def make_optimizer(cfg: Config, model: Transformer) -> nnx.Optimizer:
    """AdamW (b2 0.95, weight decay) with linear warmup, cosine decay to lr/10, clipping at 1."""
    tx = _adamw(cfg.lr, cfg.warmup, cfg.steps, cfg.weight_decay)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


@functools.cache
def _adamw(lr: float, warmup: int, steps: int, weight_decay: float):
    """The optax transform of :func:`make_optimizer`, one object per setting: the jitted steps'
    cache key holds it (its functions compare by identity), so a new run or a fresh model of the
    same shape reuses the compiled step instead of compiling it again."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup, max(steps, warmup + 1), end_value=lr / 10
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay),
    )


def train(
    cfg: Config,
    recipe=None,
    *,
    name: str | None = None,
    progress: bool = True,
    diagnose_every: int = 0,
) -> RunResult:
    """Trains one model from ``cfg.seed`` on the fixed data order; ``recipe=None`` is BF16.

    With ``diagnose_every=n`` (and a recipe), steps 1, n, 2n, ... also record the telemetry of
    every jaxmx GEMM (:mod:`jaxmx.demo.diagnose`) into ``RunResult.telemetry``; the update is
    the same, and those steps are left out of the step times.
    """
    start = time.perf_counter()
    name = name or ("bf16" if recipe is None else "mxfp8")
    train_data, val_data = data.load_splits()
    model = build_model(cfg, recipe)
    optimizer = make_optimizer(cfg, model)
    val_batches = data.eval_batches(val_data, cfg.batch, cfg.seq_len, cfg.eval_batches)
    result = RunResult(name)
    batches = data.batches(train_data, cfg.batch, cfg.seq_len, seed=cfg.seed)
    every = cfg.eval_every or max(1, cfg.steps // 10)  # steps between plain progress lines
    bar = _Progress(cfg.steps, name, every=every) if progress else None
    diagnose_every = diagnose_every if recipe is not None else 0
    taps = None  # the telemetry taps, made once the first diagnosed step has a batch
    for step in range(1, cfg.steps + 1):
        x, y = (jnp.asarray(a) for a in next(batches))
        key = step_key(cfg, recipe, step)
        if diagnose_every and (step == 1 or step % diagnose_every == 0):
            taps = taps or diagnose.taps_for(model, x, y)
            loss = _diagnosed_step(result, step, taps, model, optimizer, x, y, key)
        else:
            t0 = time.perf_counter()
            loss = float(train_step(model, optimizer, x, y, key))
            dt = time.perf_counter() - t0
            if not result.compile_time:  # the first plain step compiles it
                result.compile_time = dt
            else:
                result.step_times.append(dt)
        result.steps.append(step)
        result.train_loss.append(loss)
        val = None
        if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
            val = evaluate(model, val_batches)
            result.val_steps.append(step)
            result.val_loss.append(val)
        if bar is not None:
            bar.update(step, loss, val)
    if bar is not None:
        bar.close()
    result.wall_time = time.perf_counter() - start
    result.model = model
    return result


def _diagnosed_step(result: RunResult, step: int, taps, model, optimizer, x, y, key) -> float:
    loss, forward, tap_grads = diagnose.diagnosed_train_step(model, optimizer, x, y, taps, key)
    report = diagnostics.telemetry_report(forward, tap_grads)
    result.telemetry[step] = diagnose.as_plain(report)
    where = diagnostics.first_nonfinite(report)
    if where is not None and result.first_nonfinite is None:
        result.first_nonfinite = (step, *where)
    return float(loss)


class _Progress:
    """A run's progress on stderr: a tqdm bar on a terminal; else (a file, a pipe, a notebook) a
    plain line every ``every`` steps and at the last, so that a log holds no carriage returns."""

    def __init__(self, total: int, name: str, *, every: int):
        self.total, self.name, self.every = total, name, every
        self.start = time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"{name:>6s}", unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float, val: float | None = None) -> None:
        """After step ``step`` (1-based), its training loss and, if it validated, ``val``."""
        if self.bar is not None:
            self.bar.set_postfix(batch_loss=f"{loss:.3f}", refresh=False)
            self.bar.update()
        elif step % self.every == 0 or step == self.total:
            line = f"{self.name:>6s} step {step}/{self.total}: batch train loss {loss:.3f}"
            if val is not None:
                line += f", validation loss {val:.3f}"
            line += f" ({time.perf_counter() - self.start:.0f} s)"
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def get_recipe(name: str = "mxfp8", backend: str | None = None):
    """The recipe of a demo name, on ``backend`` if given: the ``jaxmx.recipes`` preset
    (``"mxfp8"`` -> ``MXFP8``), or for a :data:`FORMAT_RECIPES` name that format everywhere.

    Example:
        >>> get_recipe("mxfp6_e2m3").fwd, get_recipe("mxfp6_e2m3").grad
        ('mxfp6_e2m3', 'mxfp6_e2m3')
    """
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; expected one of {RECIPES}")
    if name in FORMAT_RECIPES:
        recipe = jaxmx.Recipe(fwd=name, grad=name)
    else:
        recipe = getattr(jaxmx.recipes, name.upper())
    return recipe if backend is None else dataclasses.replace(recipe, backend=backend)


def benchmark(cfg: Config, recipes: dict, *, rounds: int = 5, steps: int = 8) -> dict:
    """Seconds per training step of each ``{name: recipe}``, timed side by side.

    Other processes on a shared machine slow the separate training runs unequally, so the
    step-time ratio is measured here instead: ``rounds`` rounds, each timing ``steps`` steps of
    every variant in turn (fresh models, compiled steps), keeping each variant's fastest round.
    """
    x, y = (
        jnp.asarray(a)
        for a in next(data.batches(data.load_splits()[0], cfg.batch, cfg.seq_len, cfg.seed))
    )
    states = {}
    for name, recipe in recipes.items():
        model = build_model(cfg, recipe)
        optimizer = make_optimizer(cfg, model)
        key = step_key(cfg, recipe, 1)
        train_step(model, optimizer, x, y, key).block_until_ready()  # compiled by train()
        states[name] = (model, optimizer, key)
    best = dict.fromkeys(recipes, float("inf"))
    for _ in range(rounds):
        for name, (model, optimizer, key) in states.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = train_step(model, optimizer, x, y, key)
            loss.block_until_ready()
            best[name] = min(best[name], (time.perf_counter() - t0) / steps)
    return best


def compare(
    cfg: Config, recipe, *, name: str = "mxfp8", progress: bool = True, diagnose_every: int = 0
) -> tuple[RunResult, RunResult]:
    """BF16 then ``recipe`` (run ``name``), same seed and data order: ``(bf16_run, mx_run)``.

    Then times both training steps side by side (:func:`benchmark`) for the step-time ratio.
    ``diagnose_every``: as for :func:`train`, for the ``recipe`` run.
    """
    baseline = train(cfg, None, name="bf16", progress=progress)
    candidate = train(cfg, recipe, name=name, progress=progress, diagnose_every=diagnose_every)
    times = benchmark(cfg, {"bf16": None, name: recipe})
    baseline.bench_step_time, candidate.bench_step_time = times["bf16"], times[name]
    return baseline, candidate


def seed_band(cfg: Config, seeds: int, *, progress: bool = True) -> list[RunResult]:
    """BF16 reruns with seeds ``cfg.seed + 1 .. cfg.seed + seeds`` (weights and data order):
    with the baseline run, the run-to-run spread that a precision change should stay inside."""
    return [
        train(
            dataclasses.replace(cfg, seed=cfg.seed + i),
            None,
            name=f"bf16 seed {cfg.seed + i}",
            progress=progress,
        )
        for i in range(1, seeds + 1)
    ]


def ablations(cfg: Config, recipe, name: str) -> dict[str, tuple[Config, object]]:
    """``{variant: (cfg, recipe)}``: ``recipe`` (run ``name``), then the same with each of its
    features that is on switched off in turn: the random Hadamard transform, the 2-D weight
    tiles, stochastic gradient rounding, and the BF16 last blocks (``cfg.keep_last``).

    Example:
        >>> import jaxmx
        >>> for variant in ablations(Config(keep_last=1), jaxmx.recipes.NVFP4, "nvfp4"):
        ...     print(variant)
        nvfp4
        nvfp4 no rht
        nvfp4 no 2-D tiles
        nvfp4 nearest rounding
        nvfp4 keep_last 0
    """
    variants = {name: (cfg, recipe)}
    if recipe.rht:
        variants[f"{name} no rht"] = (cfg, recipe.replace(rht=False))
    if recipe.weight_tile:
        variants[f"{name} no 2-D tiles"] = (cfg, recipe.replace(weight_tile=None))
    if recipe.grad_rounding == "stochastic":
        variants[f"{name} nearest rounding"] = (cfg, recipe.replace(grad_rounding="nearest"))
    if cfg.keep_last:
        variants[f"{name} keep_last 0"] = (dataclasses.replace(cfg, keep_last=0), recipe)
    return variants


def ablate(cfg: Config, recipe, *, name: str, progress: bool = True) -> list[RunResult]:
    """BF16, then every variant of :func:`ablations`, all from ``cfg.seed`` on the same data
    order: ``[bf16_run, recipe_run, ablated_runs...]``."""
    runs = [train(cfg, None, name="bf16", progress=progress)]
    for variant, (variant_cfg, variant_recipe) in ablations(cfg, recipe, name).items():
        runs.append(train(variant_cfg, variant_recipe, name=variant, progress=progress))
    return runs
