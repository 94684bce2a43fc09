"""The notebooks run top to bottom (small settings through JAXMX_NB_* variables), as in Colab."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
SMALL = {
    "JAXMX_NB_STEPS": "20",
    "JAXMX_NB_D_MODEL": "32",
    "JAXMX_NB_LAYERS": "1",
    "JAXMX_NB_HEADS": "2",
    "JAXMX_NB_SEQ_LEN": "32",
    "JAXMX_NB_BATCH": "8",
    "JAXMX_NB_EVAL_EVERY": "10",
    "JAXMX_NB_EVAL_BATCHES": "2",
    "JAXMX_NB_SAMPLE_BYTES": "20",
    "JAXMX_NB_SEEDS": "1",
}


def _run(name: str, tmp_path: Path, monkeypatch) -> nbformat.NotebookNode:
    for key, value in SMALL.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("JAXMX_NB_OUT", str(tmp_path / "out"))
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    return nb


def _text(nb) -> str:
    return "\n".join(
        out.get("text", "") + str(out.get("data", {}).get("text/plain", ""))
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
    )


@pytest.mark.parametrize(
    "name", ["01_quickstart.ipynb", "02_train_transformer.ipynb", "03_diagnostics.ipynb"]
)
def test_outputs_are_cleared_in_git(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    assert "pip" in nb.cells[1].source and "find_spec" in nb.cells[1].source  # install cell


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    text = _text(_run("01_quickstart.ipynb", tmp_path, monkeypatch))
    assert "float8_e4m3fn" in text and "float8_e8m0fnu" in text
    assert "converted: ['down', 'up']" in text
    assert "same result: True" in text


def test_train_notebook_runs(tmp_path, monkeypatch):
    nb = _run("02_train_transformer.ipynb", tmp_path, monkeypatch)
    text = _text(nb)
    assert "validation loss" in text and "unigram entropy" in text
    assert (tmp_path / "out" / "loss_curves.png").exists()
    assert any(
        "image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])
    )
    assert "--- mxfp8 ---" in text


def test_diagnostics_notebook_runs(tmp_path, monkeypatch):
    nb = _run("03_diagnostics.ipynb", tmp_path, monkeypatch)
    text = _text(nb)
    assert "blocks/0/mlp/up" in text and ">limit" in text  # step 0: span ratios per layer
    assert "+promote" in text  # step 2: the accumulation probe
    assert "largest underflow_blocks" in text and "no NaN/inf in any leg" in text  # step 3
    assert (tmp_path / "out" / "telemetry.png").exists()
    assert "validation loss" in text  # step 4
    assert "bf16 over 2 seeds" in text and "the band" in text  # step 5
