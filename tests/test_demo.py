"""The demo end to end with a tiny model: both runs train, the report and the plot are written."""

import ast
import dataclasses
import graphlib
import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmx
import jaxmx.demo.commands as demo_main
import jaxmx.demo.train as demo_train
from jaxmx.demo import data, report, serve
from jaxmx.demo.cli import build_generate_parser, build_parser, cache_note, parse_args
from jaxmx.demo.commands import main
from jaxmx.demo.train import Config, get_recipe, train

TINY = [
    *("--steps", "30", "--d-model", "32", "--layers", "1", "--heads", "2"),
    *("--seq-len", "32", "--batch", "8", "--eval-every", "10", "--eval-batches", "4"),
    *("--lr", "1e-2"),
]


def test_demo_main_trains_both_and_writes_report(tmp_path, capsys):
    assert main([*TINY, "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "validation loss" in out and "step time (ms)" in out and "unigram entropy" in out
    assert "[a] both runs' compiled steps timed side by side after training" in out
    assert (
        "[c] the whole run: data, model, compilation, 30 steps at the pace they ran, 3 validations"
        in out
    )
    # the progress, not on a terminal: a line at each validation, no carriage returns
    assert "\r" not in err
    progress = [line.split(":")[0] for line in err.splitlines() if " step " in line]
    assert progress == [
        f"{name:>6s} step {s}/30" for name in ("bf16", "mxfp8") for s in (10, 20, 30)
    ]
    assert err.count(", validation loss ") == 6

    history = json.loads((tmp_path / "history.json").read_text())
    runs = history["runs"]
    assert set(runs) == {"bf16", "mxfp8"}
    assert history["config"]["keep_last"] == 0  # the FP8 recipes keep no block by default
    for run in runs.values():
        assert len(run["train_loss"]) == 30 and run["val_steps"] == [10, 20, 30]
        assert np.isfinite(run["train_loss"]).all() and np.isfinite(run["val_loss"]).all()
        assert np.mean(run["train_loss"][-5:]) < run["train_loss"][0] - 1.5  # 5.5 -> ~3
        assert run["val_loss"][-1] < run["val_loss"][0]
        assert run["step_time"] > 0
    bf16, mx = runs["bf16"], runs["mxfp8"]
    # Equal at step 0 because the attention `out` and MLP `down` projections are zero-initialized:
    # the quantized layers add nothing to the residual stream yet (same init, same first batch).
    assert bf16["train_loss"][0] == mx["train_loss"][0]
    assert bf16["train_loss"][1:] != mx["train_loss"][1:]  # the MX run really is quantized
    assert abs(mx["final_val"] / bf16["final_val"] - 1) < 0.05

    summary = (tmp_path / "summary.txt").read_text()
    assert summary.splitlines()[0].split() == ["bf16", "mxfp8", "rel.", "gap"]
    assert f"{history['unigram_entropy']:.3f}" in summary
    png = (tmp_path / "loss_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    # the bf16 model, for `generate`: restored with the run's configuration
    assert f"saved the bf16 model to {tmp_path / 'bf16_model'}" in out
    model, cfg = serve.load_model(tmp_path)
    assert dataclasses.asdict(cfg) == history["config"] and model.embed.features == 32


def test_progress_is_a_bar_on_a_terminal_else_lines(capsys, monkeypatch):
    def run():
        progress = demo_train._Progress(4, "bf16", every=2)
        for step in range(1, 5):
            progress.update(step, 1.0 / step, 0.5 if step == 4 else None)
        progress.close()
        return capsys.readouterr().err

    assert run().splitlines() == [
        "  bf16 step 2/4: batch train loss 0.500 (0 s)",
        "  bf16 step 4/4: batch train loss 0.250, validation loss 0.500 (0 s)",
    ]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = run()
    assert "\r" in bar and "4/4" in bar and "train loss" not in bar


def test_cli_flags_and_recipes():
    args = parse_args(["--recipe", "mxfp8_hybrid", "--backend", "emulate", "--d-model", "64"])
    assert args.d_model == 64 and args.out == "jaxmx_demo"
    recipe = get_recipe(args.recipe, args.backend)
    assert recipe == jaxmx.recipes.MXFP8_HYBRID.replace(backend="emulate")
    assert get_recipe("mxfp8") == jaxmx.recipes.MXFP8
    assert get_recipe("nvfp4") == jaxmx.recipes.NVFP4 and get_recipe("mxfp4") == jaxmx.recipes.MXFP4
    defaults = parse_args([])
    assert (defaults.steps, defaults.d_model, defaults.layers) == (
        Config.steps,
        Config.d_model,
        Config.layers,
    )


@pytest.mark.parametrize(
    "name, expected",
    [
        ("fp8_tensorwise", jaxmx.recipes.FP8_TENSORWISE),
        ("fp8_rowwise", jaxmx.recipes.FP8_ROWWISE),
        ("fp8_rowwise_gw_hp", jaxmx.recipes.FP8_ROWWISE_GW_HP),
        ("mxfp6_e2m3", jaxmx.Recipe(fwd="mxfp6_e2m3", grad="mxfp6_e2m3")),
        ("mxfp6_e3m2", jaxmx.Recipe(fwd="mxfp6_e3m2", grad="mxfp6_e3m2")),
        ("mxint8", jaxmx.Recipe(fwd="mxint8", grad="mxint8")),
    ],
)
def test_ladder_recipes_by_name(name, expected):
    """The per-tensor / per-row FP8 presets and the MXFP6 / MXINT8 formats are demo recipes."""
    assert parse_args(["--recipe", name]).recipe == name
    assert get_recipe(name) == expected
    assert get_recipe(name, "emulate") == expected.replace(backend="emulate")


def test_demo_main_trains_a_tensorwise_fp8_run(tmp_path):
    """``--recipe fp8_tensorwise`` end to end: both runs learn, the FP8 run is quantized."""
    args = [*TINY, "--steps", "6", "--eval-every", "0", "--recipe", "fp8_tensorwise"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    history = json.loads((tmp_path / "history.json").read_text())
    assert "fp8_e4m3_tensor" in history["recipe"]
    bf16, fp8 = history["runs"]["bf16"], history["runs"]["fp8_tensorwise"]
    for run in (bf16, fp8):
        assert len(run["train_loss"]) == 6 and np.isfinite(run["val_loss"]).all()
        assert run["train_loss"][-1] < run["train_loss"][0]
    assert bf16["train_loss"][0] == fp8["train_loss"][0]  # zero-initialized output projections
    assert bf16["train_loss"][1:] != fp8["train_loss"][1:]


def test_help_describes_every_flag_and_its_default():
    parser = build_parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        assert action.help, action.option_strings
        if action.dest != "help":
            assert f"(default: {action.default})" in text, action.option_strings
    assert "--steps STEPS training steps per run (default: 600)" in text


def test_data_splits_and_unigram():
    train, val = data.load_splits()
    assert train.dtype == np.uint8 and len(val) == int(0.1 * (len(train) + len(val)))
    h = data.unigram_entropy(val)
    assert 2.5 < h < np.log(256)
    x, y = next(data.batches(train, 4, 16, seed=0))
    assert x.shape == y.shape == (4, 16) and (x[:, 1:] == y[:, :-1]).all()
    x2, _ = next(data.batches(train, 4, 16, seed=0))
    assert (x == x2).all()  # the data order is fixed by the seed
    assert report.smooth([1.0, 2.0, 3.0], window=2).tolist() == [1.0, 1.5, 2.5]


def test_demo_diagnose_and_seed_band(tmp_path, capsys):
    args = [*TINY, "--diagnose", "--diagnose-every", "15", "--seeds", "1", "--no-progress"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert " step " not in err  # --no-progress
    assert "bf16 over 2 seeds: validation loss" in out and "the band" in out
    assert "largest underflow_blocks" in out and "no NaN/inf in any leg" in out

    history = json.loads((tmp_path / "history.json").read_text())
    assert set(history["runs"]) == {"bf16", "mxfp8", "bf16 seed 1"}
    mx = history["runs"]["mxfp8"]
    assert sorted(mx["telemetry"], key=int) == ["1", "15", "30"]
    gemms = ["blocks/0/attn/qkv", "blocks/0/attn/out", "blocks/0/mlp/up", "blocks/0/mlp/down"]
    for step_report in mx["telemetry"].values():
        assert list(step_report) == gemms
        assert all(list(legs) == ["lhs", "rhs", "dgrad", "wgrad"] for legs in step_report.values())
    png = (tmp_path / "diagnostics_mxfp8.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000

    # the diagnosed steps make the same updates as the plain ones (compiled above, steps 2 .. 14)
    cfg = Config(
        steps=30,
        d_model=32,
        layers=1,
        heads=2,
        seq_len=32,
        batch=8,
        lr=1e-2,
        eval_every=10,
        eval_batches=4,
    )
    plain = train(cfg, jaxmx.recipes.MXFP8, progress=False)
    np.testing.assert_allclose(mx["train_loss"], plain.train_loss, rtol=1e-6)


def test_keep_last_blocks_are_bf16_and_stochastic_rounding_is_seeded():
    cfg = Config(
        steps=3,
        d_model=32,
        layers=2,
        heads=2,
        seq_len=32,
        batch=8,
        lr=1e-2,
        eval_every=0,
        eval_batches=1,
        keep_last=1,
    )
    # Trains at all only if every step supplies a key: without one, jaxmx raises.
    stochastic = jaxmx.recipes.MXFP8.replace(grad_rounding="stochastic")
    run = train(cfg, stochastic, progress=False)
    # The layers of the last block compute exactly what the stock BF16 layer does with the
    # same (trained) weights; those of block 0 are quantized.
    x = jax.random.normal(jax.random.key(5), (4, 8, 32))
    bf16_like = {}
    for path, layer in nnx.iter_modules(run.model):
        if isinstance(layer, nnx.Linear) and layer.in_features == 32:
            stock = nnx.Linear(
                32, layer.out_features, use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
            )
            nnx.update(stock, nnx.state(layer))
            bf16_like["/".join(map(str, path))] = bool((layer(x) == stock(x)).all())
    assert bf16_like == {
        "blocks/0/attn/qkv": False,
        "blocks/0/attn/out": False,
        "blocks/0/mlp/up": False,
        "blocks/1/attn/qkv": True,
        "blocks/1/attn/out": True,
        "blocks/1/mlp/up": True,
        "head": True,  # never converted
    }
    # The per-step keys come from the seed: a rerun (same compiled step) is identical.
    assert train(cfg, stochastic, progress=False).train_loss == run.train_loss


def test_demo_ablate_table(tmp_path, capsys, monkeypatch):
    """``--ablate --recipe nvfp4`` trains the variants below (a stand-in ``train`` records them
    and returns made-up losses: the i-th run's is 2 (1 + i / 100)), and tabulates their gaps to
    BF16."""
    trained = []

    def fake_train(cfg, recipe, *, name, progress):
        loss = [2.0 * (1 + len(trained) / 100)]
        trained.append((name, recipe, cfg.keep_last))
        return demo_train.RunResult(name, [4], loss, [4], loss)

    monkeypatch.setattr(demo_train, "train", fake_train)
    args = [*TINY, "--steps", "4", "--layers", "2", "--recipe", "nvfp4"]
    assert main([*args, "--ablate", "--out", str(tmp_path)]) == 0
    nvfp4 = jaxmx.recipes.NVFP4
    assert trained == [
        ("bf16", None, 1),
        ("nvfp4", nvfp4, 1),  # keep_last defaults to 1 for the 4-bit recipes
        ("nvfp4 no rht", nvfp4.replace(rht=False), 1),
        ("nvfp4 no 2-D tiles", nvfp4.replace(weight_tile=None), 1),
        ("nvfp4 nearest rounding", nvfp4.replace(grad_rounding="nearest"), 1),
        ("nvfp4 keep_last 0", nvfp4, 0),
    ]
    history = json.loads((tmp_path / "history.json").read_text())
    assert history["config"]["keep_last"] == 1
    table = [(r["variant"], r["val_loss"], r["val_gap"]) for r in history["ablation"]]
    expected = [(name, 2.0 * (1 + i / 100), i / 100) for i, (name, _, _) in enumerate(trained)]
    assert table == [(n, pytest.approx(v), pytest.approx(g)) for n, v, g in expected]
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.strip() in capsys.readouterr().out
    assert summary.splitlines()[0].split() == ["variant", "validation", "loss", "gap", "to", "bf16"]
    assert summary.splitlines()[4].split() == ["nvfp4", "no", "rht", "2.0400", "+2.00%"]
    png = (tmp_path / "loss_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG")


def test_demo_advise_prints_table_and_trains_the_advised_mapping(tmp_path, capsys, monkeypatch):
    trained = []

    def fake_train(cfg, recipe, *, name, progress):  # a built (untrained) model: the advice runs
        trained.append((name, recipe))
        loss = [2.0 + len(trained) / 100]
        run = demo_train.RunResult(name, [2], loss, [2], loss)
        run.model = demo_train.build_model(cfg, recipe)
        return run

    monkeypatch.setattr(demo_main, "train", fake_train)
    args = [*TINY, "--steps", "2", "--advise", "--advise-budget", "0.05", "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    (_, mxfp8), (_, mapping) = trained
    assert mxfp8 == jaxmx.recipes.MXFP8 and [name for name, _ in trained] == ["mxfp8", "advised"]
    paths = ["blocks/0/attn/qkv", "blocks/0/attn/out", "blocks/0/mlp/up", "blocks/0/mlp/down"]
    assert list(mapping) == paths
    assert all(isinstance(r, jaxmx.Recipe) for r in mapping.values())
    for path in paths:
        assert path in out
    assert "underflow budget 5%" in out
    assert "advised  train (mean of the last 10% of steps) 2.0200" in out
    assert "the progress lines above show one step's batch loss" in out
    assert (tmp_path / "advise.txt").read_text().strip() in out
    assert (tmp_path / "granularity.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(SystemExit, match="--advise does not combine"):
        main(["--advise", "--diagnose", "--steps", "1"])


def test_demo_flag_errors():
    with pytest.raises(SystemExit, match=r"--keep-last must be in 0 \.\. --layers \(2\), got 3"):
        main(["--layers", "2", "--keep-last", "3"])
    with pytest.raises(SystemExit, match="--ablate does not combine with --diagnose"):
        main(["--ablate", "--diagnose", "--steps", "1"])
    with pytest.raises(SystemExit, match="--diagnose records the telemetry of MX and NVFP4"):
        main(["--recipe", "deepseek_fp8", "--diagnose", "--steps", "1"])


def _jaxmx_imports(path: pathlib.Path) -> tuple[set[str], list[str]]:
    """The ``jaxmx.demo`` modules that ``path`` imports, and its function-level jaxmx imports
    (the body of a module's ``if __name__ == "__main__":`` counts as its top level: the entry
    point imports the training modules there, after the command line is parsed)."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            top.update(id(inner) for inner in node.body)
    demo, nested = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        names = [n for n in names if n == "jaxmx" or n.startswith("jaxmx.")]
        if names and id(node) not in top:
            nested.append(f"{path.name}:{node.lineno}")
        demo.update(n.split(".")[2] for n in names if n.startswith("jaxmx.demo."))
    return demo, nested


def test_demo_modules_import_each_other_at_the_top_and_without_a_cycle():
    folder = pathlib.Path(jaxmx.demo.__file__).parent
    graph, nested = {}, []
    for path in sorted(folder.glob("*.py")):
        graph[path.stem], inner = _jaxmx_imports(path)
        nested += inner
    assert nested == [], f"function-level imports of jaxmx modules: {nested}"
    graphlib.TopologicalSorter(graph).prepare()  # a CycleError names the cycle


def test_a_model_generate_would_refuse_is_noted_before_training():
    assert cache_note(128, 4) is None  # the defaults: head_dim 32
    note = cache_note(64, 4)
    assert "head_dim 16 (--d-model 64 / --heads 4) is not a multiple of 32" in note
    assert "nvfp4 fits" in note and "--heads 2 gives head_dim 32" in note
    assert "gives head_dim" not in cache_note(48, 3)  # no head count makes 48 a multiple of 32


def _flag_table(after: str) -> set[str]:
    """The flags named in the first column of docs/demo.md's first table after ``after``."""
    text = (pathlib.Path(__file__).parents[1] / "docs" / "demo.md").read_text()
    rows = text[text.index(after) :].split("\n| flag |", 1)[1].split("\n\n", 1)[0].splitlines()
    return {flag for row in rows[2:] for flag in re.findall(r"`(--[a-z-]+)`", row.split("|")[1])}


@pytest.mark.parametrize(
    "after, parser", [("## Flags", build_parser), ("## Serving", build_generate_parser)]
)
def test_the_flag_tables_of_docs_demo_match_help(after, parser):
    flags = {s for a in parser()._actions for s in a.option_strings if s.startswith("--")}
    assert _flag_table(after) == flags - {"--help"}


def test_help_and_a_bad_flag_answer_before_jax_and_the_training_modules_load():
    """``python -m jaxmx.demo --help`` (and a bad flag) parses with argparse before jax, flax,
    optax, orbax and matplotlib load: ``import jaxmx`` loads each public name on first use, and
    the command line reads only the format, backend and recipe names."""
    heavy = ("jax", "jaxlib", "flax", "optax", "orbax", "matplotlib", "tqdm", "jaxmx.demo.train")
    code = (
        "import runpy, sys\n"
        "sys.argv = ['jaxmx.demo', *sys.argv[1:]]\n"
        "try:\n"
        "    runpy.run_module('jaxmx.demo', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as e:\n"
        "    print('exit:', e.code)\n"
        f"print('loaded:', sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    for argv, status in (
        (["--help"], 0),
        (["generate", "--help"], 0),
        (["--steps", "many"], 2),
        (["generate", "--cache-fmt", "fp9"], 2),
    ):
        done = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().endswith(f"exit: {status}\nloaded: []"), done.stdout[-300:]
        if status:
            assert "error: argument" in done.stderr, done.stderr
        else:
            assert "usage: python -m jaxmx.demo" in done.stdout
