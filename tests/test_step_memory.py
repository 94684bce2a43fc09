"""Peak temporary memory of a jitted training step of each recipe against the bfloat16 step.

``compiled.memory_analysis().temp_size_in_bytes`` of one-device steps (benchmarks/step_memory.py
at small shapes): the MXFP8 step needs no more than the bfloat16 one, and with each block under
jaxmx's 8-bit-residual remat policy less than bfloat16 under ``dots_saveable``; every recipe
needs no more than bfloat16 in each MLP setup of ``HOLDS`` (float32 masters cast to bfloat16
or passed as they are, unrolled or under ``lax.scan``), and with the 8-bit-residual policy no
more than bfloat16 with ``dots_saveable``, unrolled and under ``lax.scan``.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax import lax

import jaxmx
from jaxmx.demo.losses import cross_entropy
from jaxmx.demo.train import Config, build_model

DOTS = jax.checkpoint_policies.dots_saveable
EIGHT_BIT = jax.checkpoint_policies.save_only_these_names(jaxmx.LHS_COLWISE, jaxmx.RHS_COLWISE)
_NT = (((1,), (0,)), ((), ()))


def _dense(h, w, recipe, masters="cast"):
    if recipe is None or masters == "cast":
        w = w.astype(jnp.bfloat16)
    if recipe is None:
        return lax.dot_general(h, w, _NT, preferred_element_type=jnp.bfloat16)
    return jaxmx.dot_general(h, w, _NT, recipe=recipe, preferred_element_type=jnp.bfloat16)


def _mlp_temp(recipe, policy, masters="cast") -> int:
    """Two blocks ``Dense(1024) -> GELU -> Dense(256)`` on x [256, 256] bf16, f32 weights."""
    keys = jax.random.split(jax.random.key(0), 6)
    dims = (256, 1024, 256, 1024, 256)
    params = [
        jax.random.normal(k, (a, b)) * a**-0.5
        for k, a, b in zip(keys, dims, dims[1:], strict=False)
    ]
    x = jax.random.normal(keys[4], (256, 256), jnp.bfloat16)
    y = jax.random.normal(keys[5], (256, 256))

    def block(w_up, w_down, h):
        up = _dense(h, w_up, recipe, masters)
        return _dense(jax.nn.gelu(up), w_down, recipe, masters)

    def loss(params, x, y):
        h = x
        for i in (0, 2):
            run = jax.checkpoint(block, policy=policy) if policy else block
            h = run(params[i], params[i + 1], h)
        return jnp.mean((h.astype(jnp.float32) - y) ** 2)

    compiled = jax.jit(jax.grad(loss)).lower(params, x, y).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _scanned_mlp_temp(recipe, policy, masters="cast") -> int:
    """:func:`_mlp_temp`'s blocks under ``lax.scan`` (stacked weights)."""
    keys = jax.random.split(jax.random.key(0), 4)
    w_up = jax.random.normal(keys[0], (2, 256, 1024)) * 256**-0.5
    w_down = jax.random.normal(keys[1], (2, 1024, 256)) * 1024**-0.5
    x = jax.random.normal(keys[2], (256, 256), jnp.bfloat16)
    y = jax.random.normal(keys[3], (256, 256))

    def block(h, ws):
        up = _dense(h, ws[0], recipe, masters)
        return _dense(jax.nn.gelu(up), ws[1], recipe, masters), None

    body = jax.checkpoint(block, policy=policy) if policy else block

    def loss(params, x, y):
        h, _ = lax.scan(body, x, params)
        return jnp.mean((h.astype(jnp.float32) - y) ** 2)

    compiled = jax.jit(jax.grad(loss)).lower((w_up, w_down), x, y).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _demo_temp(recipe, policy) -> int:
    """The demo transformer (2 blocks, d_model 64), each block under ``nnx.remat(policy)``."""
    cfg = Config(d_model=64, layers=2, heads=2, seq_len=64, batch=8)
    graphdef, state = nnx.split(build_model(cfg, recipe))
    tokens = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)

    def loss(state, tokens):
        model = nnx.merge(graphdef, state)
        x = model.embed(tokens) + model.pos_embed[...][: cfg.seq_len].astype(model.dtype)
        for block in model.blocks:
            run = nnx.remat(lambda b, x: b(x), policy=policy) if policy else (lambda b, x: b(x))
            x = run(block, x)
        return cross_entropy(model.head(model.norm(x)).astype(jnp.float32), tokens)

    compiled = jax.jit(jax.grad(loss)).lower(state, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.fixture(
    scope="module",
    params=[_mlp_temp, _scanned_mlp_temp, _demo_temp],
    ids=["mlp", "scanned-mlp", "demo"],
)
def temps(request):
    mx = jaxmx.recipes.MXFP8
    cases = {
        "bf16": (None, None),
        "bf16 dots": (None, DOTS),
        "mx": (mx, None),
        "mx 8-bit": (mx, EIGHT_BIT),
    }
    return {name: request.param(*case) for name, case in cases.items()}


def test_mxfp8_step_needs_no_more_temp_than_bf16(temps):
    assert temps["mx"] <= temps["bf16"], temps


def test_eight_bit_remat_needs_less_temp_than_bf16_dots_saveable(temps):
    assert temps["mx 8-bit"] < temps["bf16 dots"], temps


_RECIPES = ("MXFP8", "MXFP8_2D", "FP8_TENSORWISE", "FP8_ROWWISE", "DEEPSEEK_FP8", "NVFP4")
# (recipe, loop, masters) whose step, without remat, needs no more temporaries than bf16's
# (docs/benchmarks.md, "Training-step memory", lists every setup, these and the others).
HOLDS = [
    *[(r, loop, "cast") for r in _RECIPES for loop in ("unrolled", "scan")],
    *[(r, "unrolled", "f32") for r in _RECIPES],
]
_LOOPS = {"unrolled": _mlp_temp, "scan": _scanned_mlp_temp}


@pytest.fixture(scope="module")
def bf16_temps():
    return {loop: temp(None, None) for loop, temp in _LOOPS.items()}


@pytest.mark.parametrize(("name", "loop", "masters"), HOLDS)
def test_recipe_step_needs_no_more_temp_than_bf16(name, loop, masters, bf16_temps):
    recipe = getattr(jaxmx.recipes, name)
    stochastic = recipe.grad_rounding == "stochastic"
    with jaxmx.stochastic_rounding(jax.random.key(1)) if stochastic else contextlib.nullcontext():
        temp = _LOOPS[loop](recipe, None, masters)
    assert temp <= bf16_temps[loop], (temp, bf16_temps[loop])


@pytest.fixture(scope="module")
def bf16_dots_temps():
    return {loop: temp(None, DOTS) for loop, temp in _LOOPS.items()}


@pytest.mark.parametrize("loop", tuple(_LOOPS))
@pytest.mark.parametrize("name", _RECIPES)
def test_recipe_step_with_eight_bit_remat_needs_no_more_temp_than_bf16_dots(
    name, loop, bf16_dots_temps
):
    recipe = getattr(jaxmx.recipes, name)
    stochastic = recipe.grad_rounding == "stochastic"
    with jaxmx.stochastic_rounding(jax.random.key(1)) if stochastic else contextlib.nullcontext():
        temp = _LOOPS[loop](recipe, EIGHT_BIT)
    assert temp <= bf16_dots_temps[loop], (temp, bf16_dots_temps[loop])
