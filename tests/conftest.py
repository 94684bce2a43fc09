"""Test-wide setup: 8 CPU devices, so multi-device tests run in this process, and the markers.

Set before any computation initialises the backend. Single-device tests are unaffected: arrays
and computations stay on device 0 unless a test shards them.

Markers (registered in pyproject.toml):

- ``cublaslt``: the test needs an extension built with the cuBLASLt handler (``JAXMX_CUDA=ON``;
  no GPU needed). Skipped, with the reason, on a build without it, unless ``JAXMX_CUDA=ON`` is
  set: then the handler was asked for and its absence is a failure, not a skip.
- ``gpu``: the test runs the native GEMMs on a CUDA device (tests/gpu). Skipped, with the
  reason, where there is no CUDA device or the extension lacks the cuBLASLt handler
  (:func:`jaxmx._src.gemm.capabilities.probe` says which), unless ``JAXMX_GPU_DRY_RUN=1``: then
  the CPU stands in for the GPU (tests/gpu/gpu_helpers.py). ``pytest -m gpu tests/gpu`` runs them.
- ``slow``: slow by nature (full-length runs); deselected by default, ``pytest -m slow`` runs them.
"""

import contextlib
import os
import shutil
import tempfile

import jax
import pytest

from jaxmx import _ffi
from jaxmx._src.gemm import capabilities

jax.config.update("jax_num_cpu_devices", 8)

CUDA_REQUESTED = os.environ.get("JAXMX_CUDA", "").upper() in ("ON", "1", "TRUE")


GPU_DRY_RUN = os.environ.get("JAXMX_GPU_DRY_RUN", "") == "1"


def pytest_collection_modifyitems(config, items):
    _skip_marked(items, "cublaslt", _cublaslt_missing)
    _skip_marked(items, "gpu", _gpu_missing)


def _skip_marked(items, marker: str, missing) -> None:
    """Adds a skip to the items carrying ``marker`` when ``missing()`` (asked only if some do)
    gives a reason."""
    marked = [item for item in items if marker in item.keywords]
    reason = missing() if marked else None
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in marked:
        item.add_marker(skip)


def _cublaslt_missing() -> str | None:
    if _ffi.has_cuda or CUDA_REQUESTED:
        return None
    return (
        "needs the cuBLASLt handler: this extension was built without it "
        "(JAXMX_CUDA=ON pip install -e . builds it, see docs/native.md)"
    )


def _gpu_missing() -> str | None:
    if GPU_DRY_RUN:
        return None
    here = capabilities.probe()
    if here.compute_capability is not None:
        return None
    return f"needs a CUDA device and the cuBLASLt handler: {here.no_device}"


def pytest_configure(config):
    """One persistent compilation cache for the session, shared by the xdist workers (they
    inherit the controller's environment): a program that several tests or workers compile is
    compiled once. Results are the same; only compilation is saved.
    ``JAXMX_TEST_COMPILATION_CACHE=dir`` keeps it in ``dir``; an empty value turns it off."""
    directory = os.environ.get("JAXMX_TEST_COMPILATION_CACHE")
    if directory is None:  # the controller, or a run without workers: a fresh cache
        directory = tempfile.mkdtemp(prefix="jaxmx-test-cache-")
        os.environ["JAXMX_TEST_COMPILATION_CACHE"] = directory
        config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))
    jax.config.update("jax_compilation_cache_dir", directory or None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture
def machine():
    """``machine(capabilities)``: the rest of the test traces as if this machine had
    ``capabilities`` (see tests/machines.py)."""
    with contextlib.ExitStack() as stack:
        yield lambda c: stack.enter_context(capabilities.assume(c))
