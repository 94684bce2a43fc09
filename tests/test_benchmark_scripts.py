"""Every benchmark script the docs cite imports against today's package: a name moved or
removed in jaxmx shows up here, not when someone next runs the benchmark."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py"))


@pytest.fixture
def benchmarks_on_path(monkeypatch):
    """The scripts import each other by module name (``from step_memory import ...``); two set
    ``XLA_FLAGS`` for their own process, restored here for the tests that start processes."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    yield
    for name in [n for n, m in sys.modules.items() if _is_benchmark(m)]:
        del sys.modules[name]


def _is_benchmark(module) -> bool:
    path = getattr(module, "__file__", None)
    return path is not None and pathlib.Path(path).parent == BENCHMARKS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_imports(script, benchmarks_on_path):
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[script.stem] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    if "__main__" in script.read_text():  # a script, not a helper module like timing.py
        assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
