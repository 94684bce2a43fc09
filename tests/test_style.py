"""The code base stays lint-clean and formatted: ruff (pyproject.toml) and clang-format (the C++
of ffi/ and tests/)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_ruff_check_is_clean():
    result = ruff("check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean():
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_clang_format_is_clean():
    sources = sorted(
        str(p) for d in ("ffi", "tests") for p in (ROOT / d).iterdir() if p.suffix in (".cc", ".h")
    )
    result = subprocess.run(
        ["clang-format", "--dry-run", "--Werror", *sources],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
