"""The native GEMMs captured into CUDA graphs: a fresh process with XLA's command buffers
enabled for custom calls (XLA flags must be set before JAX starts), two new shapes, each run
twice with different operands (the second run replays or updates the recorded graph), checked
against the emulation and for a command buffer in the compiled program."""

import os
import subprocess
import sys
import textwrap

import pytest
from gpu_helpers import ACCUMULATION, DRY_RUN, require

pytestmark = pytest.mark.gpu

GRAPH_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    import jaxmx
    from jaxmx import ffi

    def bound_error(out, xd, wd):
        ref = jnp.einsum("...mk,...nk->...mn", xd, wd, precision="highest")
        abs_sum = jnp.einsum("...mk,...nk->...mn", abs(xd), abs(wd), precision="highest")
        return float(jnp.max(jnp.abs(out - ref) / (float(sys.argv[2]) * abs_sum + 1e-30)))

    mx = sys.argv[1] == "mx"
    f = jax.jit(lambda a, b: 2.0 * (ffi.mx_matmul(a, b, jnp.float32) if mx else
                                    ffi.fp8_matmul(a, b, 0.5, 1.0, jnp.float32)) + 1.0)
    for shape in ((2, 136, 72, 160), (1, 520, 264, 96)):
        for run in range(2):
            ka, kb = jax.random.split(jax.random.key(10 * run + shape[1]))
            x = jax.random.normal(ka, (*shape[:2], shape[3]))
            w = jax.random.normal(kb, (shape[0], shape[2], shape[3]))
            if mx:
                a, b = jaxmx.quantize(x), jaxmx.quantize(w)
                xd, wd = jaxmx.dequantize(a), jaxmx.dequantize(b)
            else:
                a, b = x.astype(jnp.float8_e4m3fn), w.astype(jnp.float8_e4m3fn)
                xd, wd = 0.5 * a.astype(jnp.float32), b.astype(jnp.float32)
            out = (f(a, b) - 1.0) / 2.0
            text = f.lower(a, b).compile().as_text()
            print(shape, run, bound_error(out, xd, wd), "command_buffer" in text, flush=True)
    """
)


@pytest.mark.parametrize("family", ["fp8", "mx"])
def test_the_gemm_runs_in_a_command_buffer(family):
    require(family)
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {GRAPH_FLAGS}")
    env["JAX_PLATFORMS"] = "cpu" if DRY_RUN else "cuda"
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, family, str(ACCUMULATION)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 4, run.stdout  # two shapes, two runs each
    for line in lines:
        what, err, captured = line.rsplit(" ", 2)
        assert float(err) <= 1.0, f"{what}: error {float(err):.3g} of the bound"
        assert captured == "True" or DRY_RUN, f"{what}: not in a command buffer"
