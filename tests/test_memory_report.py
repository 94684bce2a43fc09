"""``jaxmx.diagnostics.memory_report``: each kind's bytes against what the test computes itself.

Leaf bytes come from numpy (``size * itemsize`` of arrays built here), the compiled sizes from
the test's own ``jax.jit(...).lower(...).compile().memory_analysis()`` of the same step, and the
saved activations from what the derivative needs: ``d/dw sum(sin(x @ w))`` needs ``cos(x @ w)``
(``x`` and ``w`` are arguments, not counted), and an MXFP8 GEMM keeps the columnwise copies of
its operands, one byte per E4M3 code and one E8M0 scale byte per 32 elements.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmx

M, K, N = 64, 128, 96
_NT = (((1,), (0,)), ((), ()))


class Momentum(NamedTuple):
    """An optimizer with two float32 buffers per parameter (an Adam-shaped state)."""

    def init(self, params):
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return (zeros, zeros)

    def update(self, grads, state, params=None):
        mu = jax.tree.map(lambda m, g: 0.9 * m + g, state[0], grads)
        nu = jax.tree.map(lambda v, g: 0.9 * v + g * g, state[1], grads)
        return jax.tree.map(lambda m: -1e-3 * m, mu), (mu, nu)


def _params():
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((K, N)).astype(np.float32),
        "b": rng.standard_normal((N,)).astype(jnp.bfloat16),
    }


def _sin_loss(p, x):
    return jnp.sum(jnp.sin(x @ p["w"] + p["b"].astype(jnp.float32)))


def _mx_loss(p, x):
    y = jaxmx.dot_general(x, p["w"], _NT, recipe=jaxmx.recipes.MXFP8)
    return jnp.mean(y) + jnp.sum(p["b"].astype(jnp.float32))


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)


@pytest.fixture(scope="module")
def report(x):
    return jaxmx.diagnostics.memory_report(
        _mx_loss, _params(), x, optimizer=Momentum(), baseline=_sin_loss
    )


def test_leaf_bytes_match_numpy(report):
    p = _params()
    param_bytes = p["w"].nbytes + p["b"].nbytes  # numpy's own count
    assert report.parameters == param_bytes == K * N * 4 + N * 2
    assert report.gradients == param_bytes  # gradients in the parameters' dtypes
    assert report.optimizer_state == 2 * 4 * (K * N + N)  # two float32 buffers per element


def test_compiled_sizes_match_memory_analysis(report, x):
    p = _params()
    opt = Momentum()

    def step(p, state, x):
        grads = jax.grad(_mx_loss)(p, x)
        updates, state = opt.update(grads, state, p)
        return jax.tree.map(lambda a, u: (a + u).astype(a.dtype), p, updates), state

    m = jax.jit(step).lower(p, opt.init(p), x).compile().memory_analysis()
    assert report.temporaries == m.temp_size_in_bytes
    assert report.arguments == m.argument_size_in_bytes
    assert report.outputs == m.output_size_in_bytes


def test_saved_activations(report):
    codes = M * K + K * N  # x and w columnwise, one byte per E4M3 code
    scales = (M // 32) * K + (K // 32) * N  # one E8M0 byte per 32 elements along M, along K
    assert report.saved_activations == codes + scales
    assert report.baseline.saved_activations == M * N * 4  # cos(x @ w + b), float32


def test_baseline_and_table(report):
    base = report.baseline
    assert base.baseline is None
    assert base.parameters == report.parameters
    ratios = report.ratios()
    assert ratios["saved_activations"] == report.saved_activations / base.saved_activations
    text = str(report)
    assert text == report.table()
    for kind in jaxmx.diagnostics.KINDS:
        assert kind.replace("_", " ") in text
    assert "baseline MiB" in text


def test_without_optimizer_or_baseline(x):
    r = jaxmx.diagnostics.memory_report(_sin_loss, _params(), x)
    assert r.optimizer_state == 0 and r.baseline is None
    assert "baseline" not in r.table()
    with pytest.raises(ValueError, match="no baseline"):
        r.ratios()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(optimizer=object()), TypeError, "init"),
        (dict(baseline=3), TypeError, "baseline must be callable"),
        (dict(baseline_params={}), ValueError, "without a baseline"),
    ],
)
def test_bad_arguments(kwargs, error, match, x):
    with pytest.raises(error, match=match):
        jaxmx.diagnostics.memory_report(_sin_loss, _params(), x, **kwargs)
    with pytest.raises(TypeError, match="loss must be callable"):
        jaxmx.diagnostics.memory_report(None, _params(), x)
