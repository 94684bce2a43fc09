"""Two processes x 4 CPU devices joined by ``jax.distributed`` (gloo): the FSDP step in MXFP8 and
MXFP4 equals one device's, and the diagnostics read global arrays (tests/multiprocess_worker.py
runs in each process and checks them)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).resolve().parent / "multiprocess_worker.py"
TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_run_the_fsdp_step_and_the_diagnostics_on_global_arrays(tmp_path):
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": ""}
    env.pop("JAXMX_TEST_COMPILATION_CACHE", None)
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i)],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        for i, log in enumerate(logs)
    ]
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outputs = [log.read_text() for log in logs]
    for i, (code, out) in enumerate(zip(codes, outputs, strict=True)):
        assert code == 0, f"process {i} exited with {code}:\n{out[-4000:]}"
        for check in ("ok fsdp MXFP8", "ok fsdp MXFP4", "ok diagnostics"):
            assert check in out, f"process {i} did not report {check!r}:\n{out[-4000:]}"
