"""jaxmx.optim against torchao's low-bit AdamW (``torchao.optim``, run on the CPU), step by step.

torchao 0.18's ``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8`` all run on the CPU (their update is
``torch.compile``d with the CPU inductor). For each, in lockstep for three steps on the same
gradients: jaxmx's ``adamw`` in the matching ``state_format`` starts every step from torchao's
parameters and stored state of the step before (its codes and scales, converted to jaxmx's
layout), and must produce

- the same stored state: codes and scales bit for bit (the schemes are the same: torchao's code
  maps, block sizes 256 / 128, absmax scales, ``absmax / 448`` for FP8, nibble order, and the
  float32 fallback of parameters under 4096 elements);
- the same parameters within a few float32 roundings of the step: ``2^-21 |p|`` for the
  decoupled weight decay and the sum, ``2^-18 lr |direction|`` for the direction's divisions
  and powers (torch and XLA may round a division by a scalar or a ``pow`` differently).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import torch
from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8, subclass_4bit, subclass_8bit

import jaxmx.optim

pytestmark = pytest.mark.interop

OPTIMIZERS = {"8bit": AdamW8bit, "4bit": AdamW4bit, "fp8": AdamWFp8}
# a block layout along the last axis, one over the whole [512, 128] weight, a float32 fallback
SHAPES = {"rows": (16, 512), "whole": (512, 128), "bias": (128,)}
LR, WD, B1, B2, EPS = 1e-2, 1e-2, 0.9, 0.999, 1e-8
STEPS = 3


def test_code_maps_are_torchaos():
    pairs = [
        (jaxmx.optim.DYNAMIC_8BIT_SIGNED, subclass_8bit.get_qmap_signed()),
        (jaxmx.optim.DYNAMIC_8BIT_UNSIGNED, subclass_8bit.get_qmap_unsigned()),
        (jaxmx.optim.DYNAMIC_4BIT_SIGNED, subclass_4bit.get_qmap_signed()),
        (jaxmx.optim.LINEAR_4BIT_UNSIGNED, subclass_4bit.get_qmap_unsigned()),
    ]
    for ours, theirs in pairs:
        np.testing.assert_array_equal(ours, np.asarray(theirs, np.float32))


def numpy_of(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().copy().view(ml_dtypes.float8_e4m3fn)
    return t.detach().numpy().copy()


def stored(state) -> dict:
    """torchao's stored moment: (codes, scales) of a subclass, or the plain float32 tensor."""
    if hasattr(state, "codes"):
        return {"codes": numpy_of(state.codes), "scales": numpy_of(state.scale)}
    return {"values": numpy_of(state)}


@pytest.fixture(scope="module", params=list(OPTIMIZERS))
def torchao_run(request):
    """torchao's parameters and stored states before and after each step, and the gradients."""
    fmt = request.param
    rng = np.random.default_rng(0)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    grads = [
        {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
        for _ in range(STEPS)
    ]
    tensors = {n: torch.nn.Parameter(torch.from_numpy(v.copy())) for n, v in init.items()}
    opt = OPTIMIZERS[fmt](list(tensors.values()), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    history = [({n: v.copy() for n, v in init.items()}, None)]
    for g in grads:
        for n, p in tensors.items():
            p.grad = torch.from_numpy(g[n].copy())
        opt.step()
        states = {
            n: {k: stored(opt.state[p][k]) for k in ("exp_avg", "exp_avg_sq")}
            for n, p in tensors.items()
        }
        history.append(({n: numpy_of(p) for n, p in tensors.items()}, states))
    return fmt, grads, history


def jaxmx_state(tx, params, states, count):
    """jaxmx's adamw state holding torchao's stored moments (None: the zero state)."""
    state = tx.init(params)
    if states is None:
        return state
    adam = state[0]

    def moment(m, theirs):
        if "values" in theirs:
            assert isinstance(m, jaxmx.optim.DenseMoment)
            return dataclasses.replace(m, values=jnp.asarray(theirs["values"]))
        return dataclasses.replace(
            m,
            codes=jnp.asarray(theirs["codes"]).reshape(m.codes.shape),
            scales=jnp.asarray(theirs["scales"]).reshape(m.scales.shape),
        )

    names = list(params)  # the parameters' order in jax.tree.leaves (sorted keys)
    mu = tuple(moment(m, states[n]["exp_avg"]) for m, n in zip(adam.mu, names, strict=True))
    nu = tuple(moment(m, states[n]["exp_avg_sq"]) for m, n in zip(adam.nu, names, strict=True))
    return (adam._replace(count=jnp.asarray(count, jnp.int32), mu=mu, nu=nu), *state[1:])


def test_same_stored_state_and_updates_within_the_bound(torchao_run):
    fmt, grads, history = torchao_run
    tx = jaxmx.optim.adamw(LR, B1, B2, EPS, weight_decay=WD, state_format=fmt)
    names = sorted(SHAPES)
    for t in range(1, STEPS + 1):
        (params_before, states_before), (params_after, states_after) = history[t - 1], history[t]
        params = {n: jnp.asarray(params_before[n]) for n in names}
        state = jaxmx_state(tx, params, states_before, t - 1)
        g = {n: jnp.asarray(grads[t - 1][n]) for n in names}
        updates, new_state = tx.update(g, state, params)
        new_params = optax.apply_updates(params, updates)
        adam = new_state[0]
        for i, n in enumerate(names):
            for key, m in (("exp_avg", adam.mu[i]), ("exp_avg_sq", adam.nu[i])):
                theirs = states_after[n][key]
                if "values" in theirs:  # the float32 fallback of a small parameter
                    np.testing.assert_array_equal(np.asarray(m.values), theirs["values"])
                    continue
                assert m.format == fmt, (n, key)
                codes = np.asarray(m.codes).reshape(-1).view(np.uint8)
                np.testing.assert_array_equal(codes, theirs["codes"].reshape(-1).view(np.uint8))
                np.testing.assert_array_equal(np.asarray(m.scales).reshape(-1), theirs["scales"])
            p = params_before[n].astype(np.float64)
            direction = (p - params_after[n]) / LR - WD * p
            bound = 2.0**-21 * np.abs(p) + 2.0**-18 * LR * np.abs(direction) + 1e-12
            assert np.all(np.abs(np.asarray(new_params[n]) - params_after[n]) <= bound), (t, n)
