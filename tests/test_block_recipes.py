"""The block-FP8 and 2-D-tile recipes (DEEPSEEK_FP8, FP8_BLOCK_POW2, MXFP8_2D) in training."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from test_dot_general import outlier_inputs as dense_outlier_inputs
from test_dot_general import ref_fake_quant, summation_bound, vjp

import jaxmx
from jaxmx.recipes import DEEPSEEK_FP8, FP8_BLOCK_POW2, MXFP8_2D

TN = (((1,), (1,)), ((), ()))


def block_fake_quant(x, fmt, mode, tile=None):
    """numpy: x [R, C] quantized along its last axis (or in tiles), dequantized in float32."""
    codes, scales = ref.block_fp8(x, fmt, mode, -1, tile)
    rows, cols = tile or (1, 128)
    expanded = np.repeat(np.repeat(scales, rows, -2), cols, -1)
    out = codes.astype(np.float32) * expanded
    return out[: x.shape[0], : x.shape[1]].astype(np.float64)


def mx_tile_fake_quant(w, tile):
    """jaxmx's tiled MX quantizer (checked bit for bit in test_block_fp8), dequantized."""
    return np.asarray(jaxmx.dequantize(jaxmx.quantize(jnp.asarray(w), tile=tile)), np.float64)


def outlier_inputs(m, k, n):
    """test_dot_general's inputs (outlier rows and columns), plus an outlier row of w: one
    128x128 weight tile then differs from the 1x128 blocks of its rows."""
    x, w, g = dense_outlier_inputs(m, k, n)
    w[9] *= 200.0
    return x, w, g


def copies(recipe, x, w, g):
    """The six float64 operands the recipe's three GEMMs must use (numpy reference)."""
    if recipe.fwd.endswith("_block"):
        fq = functools.partial(block_fake_quant, fmt=recipe.fwd, mode=recipe.scale_mode)
        w_tiled = fq(w, tile=recipe.weight_tile)
    else:
        fq = functools.partial(ref_fake_quant, fmt=recipe.fwd)
        w_tiled = mx_tile_fake_quant(w, recipe.weight_tile)
    return {
        "x_row": fq(x),
        "x_col": fq(x.T),  # [K, M] along M
        "w": w_tiled,  # [N, K]: the same values for the forward and, transposed, for dgrad
        "g_row": fq(g),
        "g_col": fq(g.T),
    }


@pytest.mark.parametrize("recipe", [DEEPSEEK_FP8, FP8_BLOCK_POW2, MXFP8_2D])
@pytest.mark.parametrize(
    "residuals, backend",
    [("quantized", "auto"), ("high_precision", "auto"), ("quantized", "ffi")],
)
def test_each_gemm_uses_the_recipes_copies(recipe, residuals, backend):
    recipe = recipe.replace(residuals=residuals, backend=backend)
    x, w, g = outlier_inputs(256, 384, 256)
    f = functools.partial(jaxmx.dot_general, dimension_numbers=TN, recipe=recipe)
    y, dx, dw = vjp(jax.jit(f), x, w, g)
    c = copies(recipe, x, w, g)
    assert np.all(np.abs(y - c["x_row"] @ c["w"].T) <= summation_bound(c["x_row"], c["w"]))
    assert np.all(np.abs(dx - c["g_row"] @ c["w"]) <= summation_bound(c["g_row"], c["w"].T))
    want_dw = c["g_col"] @ c["x_col"].T
    assert np.all(np.abs(dw - want_dw) <= summation_bound(c["g_col"], c["x_col"]))
    # 1-D blocks for the weight (not the tiles) would miss by far more
    wrong = (
        c["x_row"]
        @ (
            block_fake_quant(w, recipe.fwd, recipe.scale_mode)
            if recipe.fwd.endswith("_block")
            else ref_fake_quant(w)
        ).T
    )
    assert np.any(np.abs(wrong - y) > 100 * summation_bound(c["x_row"], c["w"]))


@pytest.mark.parametrize("recipe", [DEEPSEEK_FP8, MXFP8_2D])
def test_a_tiled_weight_is_quantized_once_per_step(recipe):
    x, w = jnp.ones((2, 64, 256)), jnp.ones((512, 256))

    def loss(x, w):
        return jaxmx.einsum("btk,nk->btn", x, w, recipe=recipe).sum()

    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w))
    # one tiled quantization (training/contract.py: tiled), used by fprop and dgrad
    assert len(re.findall(r"\bname=tiled\b", text)) == 1
    # x columnwise (the residual) here; x rowwise, g rowwise and columnwise inside the three
    # GEMMs' partitioning rules (jaxmx/_src/gemm/gathered.py); none of w
    assert len(re.findall(r"\bname=quantized\b", text)) == 1
    assert text.count("custom_partitioning") == 4  # the three GEMMs and the tiled weight


@pytest.mark.parametrize("recipe", [MXFP8_2D, DEEPSEEK_FP8, FP8_BLOCK_POW2])
def test_the_native_gemm_equals_the_emulation(recipe):
    """backend="ffi" (the CPU handlers) against backend="emulate", forward and backward, with
    M, N not multiples of 128 (partial weight tiles)."""
    x, w, g = outlier_inputs(200, 256, 136)
    f = functools.partial(jaxmx.dot_general, dimension_numbers=TN)
    emulated = vjp(jax.jit(functools.partial(f, recipe=recipe.replace(backend="emulate"))), x, w, g)
    native = vjp(jax.jit(functools.partial(f, recipe=recipe.replace(backend="ffi"))), x, w, g)
    for a, b in zip(emulated, native, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())


def test_recipe_validation():
    with pytest.raises(ValueError, match="scale_mode 'rceil' for fp8_e4m3_block"):
        jaxmx.Recipe(fwd="fp8_e4m3_block", grad="fp8_e4m3_block")
    with pytest.raises(ValueError, match=r"weight_tile must be None or \(32, 32\)"):
        jaxmx.Recipe(weight_tile=(128, 128))
    with pytest.raises(ValueError, match="MX GEMMs only"):
        DEEPSEEK_FP8.replace(accum_bits=14)
    assert DEEPSEEK_FP8.weight_tile == (128, 128) and FP8_BLOCK_POW2.scale_mode == "pow2"


def test_a_weight_sharded_through_a_tile_is_refused():
    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        x = jnp.ones((16, 256))
        w = jax.device_put(jnp.ones((512, 256)), jax.P("model", None))  # 64 rows per shard
        with pytest.raises(jaxmx.BlockShardingError, match="rhs axis N"):
            jaxmx.dot_general(x, w, TN, recipe=DEEPSEEK_FP8)  # half a 128x128 tile per shard
        y = jaxmx.dot_general(x, w, TN, recipe=MXFP8_2D)  # two 32x32 tiles per shard
        assert y.shape == (16, 512)
