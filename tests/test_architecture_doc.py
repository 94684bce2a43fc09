"""docs/architecture.md lists every module of ``jaxmx/_src``, and only those.

A module is each ``.py`` file under ``jaxmx/_src`` but the ``__init__.py`` files (the layers'
docstring-only ones, and the ``gemm/native`` package's re-exports), named by its path below
``_src``: ``core/formats.py``, ``gemm/native/mx.py``. The doc's "Modules" section lists them in
tables, one per layer heading (``**core/**``: rows name ``formats.py``, ``native/mx.py``) or,
under a heading of several layers, with the layer in the name (``training/scope.py``). The files
are read, nothing is imported.
"""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
SRC = REPO / "jaxmx" / "_src"
DOC = REPO / "docs" / "architecture.md"


def source_modules(src: pathlib.Path) -> set[str]:
    """Every module under ``src``, as its path relative to ``src``."""
    return {p.relative_to(src).as_posix() for p in src.rglob("*.py") if p.name != "__init__.py"}


def documented_modules(doc: str) -> set[str]:
    """The modules the "Modules" section of the architecture doc lists, as paths below ``_src``."""
    section = doc.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    found, layer = set(), ""
    for line in section.splitlines():
        if line.startswith("**"):
            single = re.fullmatch(r"\*\*(\w+)/\*\*", line.strip())
            layer = f"{single.group(1)}/" if single else ""
        elif line.startswith("| `"):
            found |= {layer + name for name in re.findall(r"`([\w/]+\.py)`", line.split("|")[1])}
    return found


def problems(src: pathlib.Path, doc: str) -> list[str]:
    """Each module the doc does not list, and each listed module that does not exist."""
    have, listed = source_modules(src), documented_modules(doc)
    return [f"not in docs/architecture.md: {m}" for m in sorted(have - listed)] + [
        f"in docs/architecture.md but not in jaxmx/_src: {m}" for m in sorted(listed - have)
    ]


def test_the_architecture_doc_lists_every_module():
    assert {"core/formats.py", "gemm/native/mx.py"} <= source_modules(SRC)
    assert problems(SRC, DOC.read_text()) == []


def test_the_checker_names_missing_and_stale_modules(tmp_path):
    for name in ("core/a.py", "core/__init__.py", "gemm/native/mx.py", "training/t.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    doc = "\n".join(
        [
            "# Architecture",
            "## Modules",
            "**core/**",
            "| module | concept |",
            "|---|---|",
            "| `a.py`, `gone.py` | a |",
            "**gemm/**",
            "| `native.py` | the GEMMs |",
            "**training/**, **flax/**",
            "| `training/t.py` | t |",
            "## Data flow",
            "| `gemm/native/mx.py` | outside the section |",
        ]
    )
    assert problems(tmp_path, doc) == [
        "not in docs/architecture.md: gemm/native/mx.py",
        "in docs/architecture.md but not in jaxmx/_src: core/gone.py",
        "in docs/architecture.md but not in jaxmx/_src: gemm/native.py",
    ]
