"""Fixtures of the GPU tests: the device under test and the CPU whose handler is the second
reference. Every test here carries the ``gpu`` marker; tests/conftest.py skips them, with the
reason, where there is no CUDA device or the extension lacks the cuBLASLt handler."""

import jax
import pytest
from gpu_helpers import DRY_RUN


@pytest.fixture(scope="session")
def gpu():
    """The first CUDA device (the CPU in a dry run, ``JAXMX_GPU_DRY_RUN=1``)."""
    return jax.devices("cpu")[0] if DRY_RUN else jax.devices("cuda")[0]


@pytest.fixture(scope="session")
def cpu():
    return jax.devices("cpu")[0]
