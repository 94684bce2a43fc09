"""No XLA alarm in a user's output: the README example, ``advise`` on a small demo model and one
training step of each recipe (on two GEMM shapes) compile without XLA's
``slow_operation_alarm`` ("Constant folding an instruction is taking > 1s") or "Very slow
compile", and hand XLA no large constant work (:mod:`constant_work`, the machine-independent
cause of the first alarm).

XLA prints its alarms from C++ to the process's stderr, so everything runs in one subprocess
whose stderr is read here.
"""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALARMS = ("slow_operation_alarm", "Constant folding", "Very slow compile")

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    import jaxmx
    from constant_work import constant_work

    def section(name):
        print(f"== {name}", flush=True)
        print(f"== {name}", file=sys.stderr, flush=True)

    section("readme")
    readme = open("README.md").read()
    code = "\\n".join(re.findall(r"```python\\n(.*?)```", readme, re.S))
    scope = {}
    exec(code, scope)
    grad = jax.grad(scope["loss"], argnums=(0, 1))
    for found in constant_work(grad, scope["x"], scope["w"]):
        print("CONSTANT", found)

    section("advise")
    from jaxmx._src.diagnostics import level_stats, levels
    from jaxmx.demo import advise
    from jaxmx.demo.train import Config, build_model, get_recipe
    cfg = Config(d_model=32, layers=1, heads=2, seq_len=32, batch=8)
    advice = advise.advise_model(build_model(cfg, get_recipe("mxfp8")), cfg, 0.05)
    print("advised", len(advice))
    chosen = levels.levels_named("fp8_e4m3", levels.available_levels("fp8_e4m3", 2))
    measure = lambda x: level_stats.measure(x, axis=1, levels=chosen)
    for found in constant_work(measure, jnp.ones((256, 100))):
        print("CONSTANT", found)

    section("recipes")
    # a square GEMM, and one with a batch dim and a K-first weight whose per-row scales and
    # blocks number 1024 or more
    cases = [
        ("md,nd->mn", (128, 128), (128, 128)),
        ("bmd,dn->bmn", (2, 64, 1024), (1024, 384)),
    ]
    key = jax.random.key(2)
    for name in dir(jaxmx.recipes):
        recipe = getattr(jaxmx.recipes, name)
        if not isinstance(recipe, jaxmx.Recipe):
            continue
        for spec, x_shape, w_shape in cases:
            x = jax.random.normal(jax.random.key(0), x_shape, jnp.bfloat16)
            w = jax.random.normal(jax.random.key(1), w_shape, jnp.float32)
            def loss(x, w, key, recipe=recipe, spec=spec):  # a fresh key each step: an argument
                with jaxmx.stochastic_rounding(key):
                    return jaxmx.einsum(spec, x, w, recipe=recipe).sum()
            step = jax.grad(loss, argnums=(0, 1))
            jax.block_until_ready(jax.jit(step)(x, w, key))
            for found in constant_work(step, x, w, key):
                print("CONSTANT", name, spec, found)
        print("step", name, flush=True)
    """
)


@pytest.fixture(scope="module")
def run():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), *sys.path]))
    env.pop("JAXMX_TEST_COMPILATION_CACHE", None)  # compile for real: the alarms come from XLA
    proc = subprocess.run(
        [sys.executable, "-c", "import re\n" + SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _sections(proc.stdout), _sections(proc.stderr)


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^== (\w+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.parametrize("section", ["readme", "advise", "recipes"])
def test_no_xla_alarm_and_no_constant_work(run, section):
    out, err = run
    alarms = [line for line in err[section].splitlines() if any(a in line for a in ALARMS)]
    assert not alarms, f"{section}: XLA alarms on stderr:\n" + err[section][-4000:]
    constant = [line for line in out[section].splitlines() if line.startswith("CONSTANT")]
    assert not constant, f"{section}: XLA would fold these at compile time: {constant[:10]}"


def test_every_recipe_stepped(run):
    out, _ = run
    import jaxmx

    names = [n for n in dir(jaxmx.recipes) if isinstance(getattr(jaxmx.recipes, n), jaxmx.Recipe)]
    assert re.findall(r"^step (\w+)$", out["recipes"], flags=re.M) == names
