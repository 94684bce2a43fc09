"""Every Python example in README.md and docs/*.md runs as written.

Each document's ```python blocks run in order, in one fresh namespace (a reader who runs the
document top to bottom), in a new Python process in an empty temporary directory. A block that
cannot run here (a GPU, a download, a long run) is marked in the markdown by the line just
before its fence, ``<!-- example: skip (the reason) -->``; the test counts those, and a mark
without a reason fails. Documents whose examples take minutes on a CPU (:data:`SLOW`) run under
``pytest -m slow``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))]
SKIP = re.compile(r"<!-- example: skip \((?P<reason>[^)]+)\) -->")
FENCE = re.compile(r"^```python\n(?P<code>.*?)^```$", re.M | re.S)

RUNNER = """
import json, sys, traceback
blocks = json.loads(sys.stdin.read())
namespace = {"__name__": "__main__"}
for line, code in blocks:
    try:
        exec(compile(code, f"{sys.argv[1]}:{line}", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"the example at {sys.argv[1]}:{line} failed")
"""


def examples(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(runnable, skipped)``: each block's first line number with its code, or its reason."""
    runnable, skipped = [], []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = SKIP.fullmatch(before.strip())
        if "example: skip" in before and mark is None:
            raise AssertionError(f"line {line - 1}: a skip mark needs a reason: {before!r}")
        if mark:
            skipped.append((line + 1, mark["reason"]))
        else:
            runnable.append((line + 1, match["code"]))
    return runnable, skipped


def test_the_extractor_finds_blocks_and_marks():
    text = "a\n```python\nx = 1\n```\n<!-- example: skip (needs a GPU) -->\n```python\ny\n```\n"
    runnable, skipped = examples(text)
    assert runnable == [(3, "x = 1\n")] and skipped == [(7, "needs a GPU")]
    with pytest.raises(AssertionError, match="needs a reason"):
        examples("<!-- example: skip -->\n```python\nz\n```\n")


SLOW = {
    "docs/diagnostics.md": "its telemetry and advise examples compile a training step of the demo "
    "model at every scaling level: minutes on 2 busy CPU cores",
}
"""Documents whose examples take minutes here: marked ``slow`` (``pytest -m slow`` runs them)."""


@pytest.mark.parametrize(
    "document",
    [pytest.param(d, marks=pytest.mark.slow) if d in SLOW else d for d in DOCUMENTS],
)
def test_the_examples_run_as_written(document, tmp_path):
    runnable, skipped = examples((ROOT / document).read_text())
    if not runnable:
        pytest.skip(f"{document}: no runnable example ({len(skipped)} marked to skip)")
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, document],
        input=json.dumps(runnable),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"{document}: {len(runnable)} examples ran, {len(skipped)} marked to skip: {skipped}")
