"""The notebooks run top to bottom (small settings through JAXMX_NB_* variables), and their
install cell installs jaxmx only where it is missing."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ["01_quickstart.ipynb", "02_train_transformer.ipynb", "03_diagnostics.ipynb"]
SMALL = {
    "JAXMX_NB_STEPS": "20",
    "JAXMX_NB_D_MODEL": "32",
    "JAXMX_NB_LAYERS": "1",
    "JAXMX_NB_HEADS": "1",  # head_dim 32: an MXFP8 KV cache (02's serving cell)
    "JAXMX_NB_SEQ_LEN": "32",
    "JAXMX_NB_BATCH": "8",
    "JAXMX_NB_EVAL_EVERY": "10",
    "JAXMX_NB_EVAL_BATCHES": "2",
    "JAXMX_NB_SAMPLE_BYTES": "20",
    "JAXMX_NB_SEEDS": "1",
}


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory) -> Path:
    """A persistent compilation cache for this module's kernels: the notebooks compile the same
    training steps (same settings), each kernel would otherwise compile them again."""
    return tmp_path_factory.mktemp("jax_cache")


def _run(name: str, tmp_path: Path, monkeypatch, jax_cache: Path) -> nbformat.NotebookNode:
    for key, value in SMALL.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("JAXMX_NB_OUT", str(tmp_path / "out"))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(jax_cache))
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    _execute(nb, name, tmp_path, budget_s())
    return nb


def budget_s() -> float:
    """Seconds a notebook may take in all (``JAXMX_NB_BUDGET_S``, default 1800: many times what
    the small settings take on 2 busy CPU cores); no single cell has a limit of its own."""
    return float(os.environ.get("JAXMX_NB_BUDGET_S", "1800"))


def _execute(nb, name: str, tmp_path: Path, budget: float) -> None:
    """Runs ``nb`` in a kernel, each cell within what is left of ``budget`` seconds for the whole
    notebook; a notebook past its budget fails with a message that says so."""
    deadline = time.monotonic() + budget
    client = NotebookClient(
        nb,
        timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    try:
        client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    except CellTimeoutError as e:
        raise TimeoutError(
            f"{name} did not finish within its budget of {budget:.0f} s for the whole notebook: "
            "the machine is slow or busy (no cell failed); set JAXMX_NB_BUDGET_S to allow more"
        ) from e


def _text(nb) -> str:
    return "\n".join(
        out.get("text", "") + str(out.get("data", {}).get("text/plain", ""))
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
    )


def _install_cell() -> str:
    return nbformat.read(NOTEBOOKS / NAMES[0], as_version=4).cells[1].source


@pytest.mark.parametrize("name", NAMES)
def test_outputs_are_cleared_in_git(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    assert "pip" in nb.cells[1].source and "find_spec" in nb.cells[1].source  # install cell
    assert nb.cells[1].source == _install_cell()  # the same in every notebook, tested below


def _run_install_cell(tmp_path: Path, cwd: Path, *, isolated: bool):
    """Runs the install cell in a new Python in ``cwd`` (beside a folder ``jaxmx`` that is no
    package), with a stand-in ``pip`` that records its arguments and "installs" a jaxmx package
    on the path: (return code, stderr, pip's arguments or None). ``isolated``: without site
    packages or this process's path, so that no installed jaxmx is found."""
    (cwd / "jaxmx").mkdir(parents=True)
    fakes = tmp_path / "fakes"
    (fakes / "pip").mkdir(parents=True)
    (fakes / "pip" / "__init__.py").write_text("")
    (fakes / "pip" / "__main__.py").write_text(
        "import json, pathlib, sys\n"
        "here = pathlib.Path(__file__).parent.parent\n"
        "(here / 'pip_args.json').write_text(json.dumps(sys.argv[1:]))\n"
        "(here / 'jaxmx').mkdir()\n"
        "(here / 'jaxmx' / '__init__.py').write_text('')\n"
    )
    path = [str(fakes)] if isolated else [str(fakes), *sys.path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    flags = ["-S"] if isolated else []
    proc = subprocess.run(
        [sys.executable, *flags, "-c", _install_cell()],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    args = fakes / "pip_args.json"
    return proc.returncode, proc.stderr, json.loads(args.read_text()) if args.exists() else None


def test_install_cell_keeps_an_installed_jaxmx(tmp_path):
    assert _run_install_cell(tmp_path, tmp_path / "work", isolated=False) == (0, "", None)


def test_install_cell_without_jaxmx_outside_a_clone_says_how(tmp_path):
    returncode, stderr, pip_args = _run_install_cell(tmp_path, tmp_path / "work", isolated=True)
    assert returncode != 0 and pip_args is None
    assert "ModuleNotFoundError: jaxmx is not installed" in stderr
    assert 'pip install -e ".[demo]"' in stderr


def test_install_cell_without_jaxmx_installs_the_clone_it_sits_in(tmp_path):
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "pyproject.toml").write_text('[project]\nname = "jaxmx"\n')
    returncode, stderr, pip_args = _run_install_cell(tmp_path, clone / "notebooks", isolated=True)
    assert (returncode, stderr) == (0, "")
    assert pip_args == ["install", "-q", "-e", f"{clone}[demo]"]


def test_quickstart_notebook_runs(tmp_path, monkeypatch, jax_cache):
    text = _text(_run("01_quickstart.ipynb", tmp_path, monkeypatch, jax_cache))
    assert "float8_e4m3fn" in text and "float8_e8m0fnu" in text
    for layer, recipe, reason in [
        ("up", "MXFP8", "converted"),
        ("down", "MXFP8", "converted"),
        ("head", "high precision", "excluded by default: 'head'"),
        ("embed", "high precision", "embedding table"),
    ]:  # the conversion report's table
        assert re.search(rf"{layer} +\w+ +{recipe} +{reason}", text), layer
    assert "same result: True" in text


def test_train_notebook_runs(tmp_path, monkeypatch, jax_cache):
    nb = _run("02_train_transformer.ipynb", tmp_path, monkeypatch, jax_cache)
    text = _text(nb)
    assert "validation loss" in text and "unigram entropy" in text
    assert (tmp_path / "out" / "loss_curves.png").exists()
    assert any(
        "image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])
    )
    assert "--- mxfp8 ---" in text
    assert "mxfp8_e4m3 weights, mxfp8_e4m3 cache: " in text  # the serving cell
    assert "per-token agreement" in text and "KV cache (bytes)" in text


def test_diagnostics_notebook_runs(tmp_path, monkeypatch, jax_cache):
    nb = _run("03_diagnostics.ipynb", tmp_path, monkeypatch, jax_cache)
    text = _text(nb)
    assert "blocks/0/mlp/up" in text and ">limit" in text  # step 0: span ratios per layer
    assert "+promote" in text  # step 2: the accumulation probe
    assert "largest underflow_blocks" in text and "no NaN/inf in any leg" in text  # step 3
    assert (tmp_path / "out" / "telemetry.png").exists()
    assert "validation loss" in text  # step 4
    assert "bf16 over 2 seeds" in text and "the band" in text  # step 5


def test_a_notebook_past_its_budget_says_the_machine_is_slow(tmp_path):
    """The budget covers the whole notebook: two cells of 1.5 s each pass no per-cell limit of
    2 s, and together exceed a budget of 2 s."""
    cells = [nbformat.v4.new_code_cell("import time; time.sleep(1.5)") for _ in range(2)]
    nb = nbformat.v4.new_notebook(cells=cells)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"slow\.ipynb did not finish within its budget of 2 s"):
        _execute(nb, "slow.ipynb", tmp_path, 2)
    assert time.monotonic() - start < 60
