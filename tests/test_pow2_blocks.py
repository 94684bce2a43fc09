"""Block FP8 with power-of-two scales re-encoded as MXFP8 (the Blackwell path of FP8_BLOCK_POW2)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from machines import BLACKWELL
from test_block_fp8 import adversarial

import jaxmx
from jaxmx._src.quantize.pow2_blocks import as_mx
from jaxmx.recipes import DEEPSEEK_FP8, FP8_BLOCK_POW2


@pytest.mark.parametrize("fmt", ["fp8_e4m3_block", "fp8_e5m2_block"])
@pytest.mark.parametrize("layout", [(1, None), (0, None), (1, (128, 128))])
def test_the_mx_array_holds_the_same_values(fmt, layout):
    axis, tile = layout
    x = adversarial()  # NaN/inf, zero and subnormal blocks, outliers, padding
    x[0, :128] = 1e-39  # a block whose power-of-two scale is 2^-127 (E8M0 byte 0)
    q = jaxmx.quantize(jnp.asarray(x), fmt, axis=axis, scale_mode="pow2", tile=tile)
    mx = as_mx(q)
    assert mx.fmt == fmt.replace("fp8", "mxfp8").replace("_block", "") and mx.tile is None
    # exact values code * 2^k from q's fields, in float64 (the block-FP8 dequantize is a
    # float32 product, flushed below 2^-126 on XLA:CPU; the MX one is exact)
    rows, cols = tile or ((1, 128) if axis == 1 else (128, 1))
    scale = np.repeat(np.repeat(np.asarray(q.scale, np.float64), rows, 0), cols, 1)
    want = np.asarray(q.data, np.float64) * scale[: q.data.shape[0], : q.data.shape[1]]
    want = want[: x.shape[0], : x.shape[1]]
    np.testing.assert_array_equal(np.asarray(jaxmx.dequantize(mx), np.float64), want)


def test_the_native_mx_gemm_computes_the_block_gemm():
    x = jax.random.normal(jax.random.key(0), (3, 64, 384)) * 100.0
    w = jax.random.normal(jax.random.key(1), (3, 48, 384))
    a = jaxmx.quantize(x, "fp8_e4m3_block", scale_mode="pow2")
    b = jaxmx.quantize(w, "fp8_e4m3_block", scale_mode="pow2", tile=(128, 128))
    emulated = jaxmx.matmul(a, b, jnp.float32, backend="emulate")
    native = jaxmx.matmul(as_mx(a), as_mx(b), jnp.float32, backend="ffi")  # the CPU handler
    scale = float(np.abs(emulated).max())  # float32 summation orders differ: errors ~ 2^-24 K
    np.testing.assert_allclose(native, emulated, rtol=0, atol=1e-5 * scale)


def test_only_block_fp8_arrays_are_taken():
    with pytest.raises(ValueError, match="as_mx takes block-FP8 arrays"):
        as_mx(jaxmx.quantize(jnp.ones((4, 64))))
    narrow = jaxmx.quantize(
        jnp.ones((128, 128)), "fp8_e4m3_block", scale_mode="pow2", tile=(128, 64)
    )
    with pytest.raises(ValueError, match="tiles must be 128 wide"):
        as_mx(narrow)


@pytest.mark.cublaslt
def test_auto_runs_pow2_block_recipes_on_the_mx_gemm_of_a_blackwell(machine):
    """On a CUDA device with the MX GEMM and without cuBLASLt's block-FP8 one, FP8_BLOCK_POW2's
    three GEMMs lower to the MX custom call; DEEPSEEK_FP8 (float32 scales) is emulated."""
    machine(BLACKWELL)
    x, w = jnp.ones((8, 256)), jnp.ones((128, 256))

    def step(recipe):
        def loss(x, w):
            return jaxmx.dot_general(x, w, (((1,), (1,)), ((), ())), recipe=recipe).sum()

        step = jax.jit(jax.value_and_grad(loss, (0, 1)))
        return step.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()

    assert step(FP8_BLOCK_POW2).count("jaxmx_mx_matmul") == 3
    assert "jaxmx_mx_matmul" not in step(DEEPSEEK_FP8)
    assert "jaxmx_block_fp8_matmul" not in step(DEEPSEEK_FP8)
