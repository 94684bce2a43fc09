"""Multi-device training with JAX SPMD: data, FSDP, tensor and sequence parallel, shard_map, vmap.

The scenarios live in tests/spmd_cases.py and run in one fresh interpreter with 8 CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before jax is imported, and
the rest of the suite imports jax with one device in this process). Each scenario below is one
test that reports that scenario's outcome; see spmd_cases.py for what each one checks.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "spmd_cases.py"
CASES = [
    "data_parallel",
    "fsdp",
    "tensor_parallel",
    "data_and_tensor_parallel",
    "fsdp_and_tensor_parallel",
    "row_parallel_layer",
    "sequence_parallel_reduce_scatter",
    "flax_linen_mlp",
    "vmap_over_sharded_experts",
    "shard_map_data_parallel",
    "misaligned_shards_raise",
    "inference_needs_only_k_aligned",
    "explicit_axes_raise_while_tracing",
    "docs_distributed_example",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("spmd") / "results.json"
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    found = json.loads(out.read_text()) if out.exists() else {}
    return proc, found


def test_every_case_is_listed_here():
    import ast

    tree = ast.parse(SCRIPT.read_text())
    defined = [
        f.name
        for f in tree.body
        if isinstance(f, ast.FunctionDef)
        and any(getattr(d, "id", None) == "case" for d in f.decorator_list)
    ]
    assert defined == CASES


@pytest.mark.parametrize("name", CASES)
def test_spmd_case(results, name):
    proc, found = results
    if name not in found:
        pytest.fail(
            f"{name} did not run (exit code {proc.returncode}).\nstdout:\n{proc.stdout[-3000:]}"
            f"\nstderr:\n{proc.stderr[-6000:]}"
        )
    outcome = found[name]
    assert outcome["ok"], outcome["error"]
    print(json.dumps(outcome["info"], indent=1))
