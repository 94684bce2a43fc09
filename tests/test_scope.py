"""jaxmx._src.training.scope: the GEMMs' trace-time state is per thread and per context, and
the training layer never imports the layers above it."""

import ast
import contextvars
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

import jaxmx
from jaxmx import diagnostics
from jaxmx._src.training import scope

DIMS = (((1,), (1,)), ((), ()))
X, W = jnp.ones((8, 32)), jnp.ones((4, 32))
SRC = pathlib.Path(jaxmx.__file__).parent / "_src"


def in_thread(name: str, key: jax.Array, barrier: threading.Barrier, out: dict) -> None:
    """Opens this thread's telemetry, named and stochastic_rounding blocks, waits until the
    other thread has opened its own, then runs one GEMM and draws one key."""
    with diagnostics.telemetry() as record, diagnostics.named(name), jaxmx.stochastic_rounding(key):
        barrier.wait()
        jaxmx.dot_general(X, W, DIMS)
        out[name] = (list(record.forward), scope.gemm_name(), scope.next_key())
        barrier.wait()


def test_two_threads_do_not_see_each_others_blocks():
    """Failed before scope.py: named() and telemetry() were module-global lists, so both GEMMs
    were named 'a/b' (or 'b/a') and recorded in the last-opened block."""
    barrier, out = threading.Barrier(2), {}
    keys = {"a": jax.random.key(1), "b": jax.random.key(2)}
    threads = [
        threading.Thread(target=in_thread, args=(n, keys[n], barrier, out)) for n in ("a", "b")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in ("a", "b"):
        recorded, gemm_name, key = out[name]
        assert recorded == [name] and gemm_name == name
        want = jax.random.key_data(jax.random.fold_in(keys[name], 0))
        np.testing.assert_array_equal(jax.random.key_data(key), want)
    assert scope.observer() is None and scope.gemm_name() == "dot_general"


def test_a_copied_context_keeps_the_state_at_copy_time():
    """Failed before scope.py: after the blocks closed, the copy saw no name and no telemetry
    block, and the key counter was shared with the original context."""
    key = jax.random.key(0)
    with diagnostics.telemetry() as record, diagnostics.named("outer"):
        with jaxmx.stochastic_rounding(key):
            scope.next_key()  # fold_in(key, 0)
            copied = contextvars.copy_context()
            scope.next_key()  # fold_in(key, 1), in this context only
    outside = contextvars.copy_context()

    def use():
        jaxmx.dot_general(X, W, DIMS)
        return scope.gemm_name(), scope.observer(), scope.next_key()

    name, observer, drawn = copied.run(use)
    assert name == "outer" and observer is record and list(record.forward) == ["outer"]
    want = jax.random.key_data(jax.random.fold_in(key, 1))
    np.testing.assert_array_equal(jax.random.key_data(drawn), want)
    with diagnostics.named("later"):  # a copy made outside every block sees none of them
        assert outside.run(use) == ("dot_general", None, None)


def test_named_nests_and_unwinds():
    with diagnostics.named("a"):
        with diagnostics.named("b"):
            assert scope.gemm_name() == "a/b"
        assert scope.gemm_name("ragged_dot") == "a"
    assert scope.gemm_name("ragged_dot") == "ragged_dot"


def imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return names


def test_the_training_layer_imports_no_higher_layer():
    """Failed before scope.py: training/dot_general.py imported diagnostics.telemetry, and
    training/attention.py its `named`."""
    higher = ("jaxmx._src.diagnostics", "jaxmx._src.flax", "jaxmx.diagnostics", "jaxmx.flax")
    for path in sorted((SRC / "training").glob("*.py")):
        bad = [m for m in imported_modules(path) if m.startswith(higher)]
        assert not bad, f"{path.name} imports {bad}"


def test_telemetry_uses_no_private_jax_module():
    """Failed before: telemetry read the current trace from jax._src.core."""
    bad = [m for m in imported_modules(SRC / "diagnostics" / "telemetry.py") if "_src" in m]
    assert all(m.startswith("jaxmx.") for m in bad), bad
