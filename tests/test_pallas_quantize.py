"""The Pallas quantizers (interpreted on the CPU) give the XLA quantizers' bytes.

``impl="xla"`` is checked against the independent reference in tests/test_quantize.py; here
``impl="pallas"`` must equal it byte for byte: codes and scales of both copies, compact and
swizzled, on the quantizer tests' adversarial corpus, for every format and scale mode, with
round-to-nearest and stochastic rounding. Sizes are small: interpret mode is slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference as ref
from test_quantize import CORPUS, FORMATS, MODES

import jaxmx
from jaxmx._src import quantize as quantize_module

ALL = [(f, m) for f in FORMATS for m in MODES]


def _same_bytes(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(la, lb, strict=True):
        assert u.dtype == v.dtype and u.shape == v.shape
        np.testing.assert_array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8))


def _corpus_matrix() -> np.ndarray:
    """The corpus as [rows, 160]: tiles with NaN/Inf blocks, every scale edge, and a K that is
    not a multiple of the 128-element tile (nor an M, along the columns)."""
    flat = CORPUS.reshape(-1)
    rows = flat.size // 160
    return flat[: rows * 160].reshape(rows, 160)[:300]


@pytest.mark.parametrize(("fmt", "mode"), ALL)
def test_rowwise_colwise_corpus(fmt, mode):
    x = jnp.asarray(_corpus_matrix())
    got = jaxmx.quantize_rowwise_colwise(x, fmt, mode, impl="pallas", swizzled_scales=True)
    want = jaxmx.quantize_rowwise_colwise(x, fmt, mode, impl="xla", swizzled_scales=True)
    _same_bytes(got, want)
    row, col_t = got[:2]
    assert (row.shape, col_t.shape) == (x.shape, x.shape[::-1])
    # the swizzled buffers are the compact scales in the cuBLAS layout
    np.testing.assert_array_equal(
        np.asarray(got[2]), ref.swizzle(np.asarray(row.scale).view(np.uint8))
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_rowwise_colwise_stochastic_rounding(fmt):
    x = jnp.asarray(_corpus_matrix()[:140], jnp.bfloat16)
    key = jax.random.key(1)
    got = jaxmx.quantize_rowwise_colwise(x, fmt, key=key, impl="pallas")
    _same_bytes(got, jaxmx.quantize_rowwise_colwise(x, fmt, key=key, impl="xla"))
    nearest = jaxmx.quantize_rowwise_colwise(x, fmt, impl="pallas")
    assert (np.asarray(nearest[0].data) != np.asarray(got[0].data)).any()


@pytest.mark.parametrize(
    ("shape", "axis", "dtype"),
    [
        ((200, 160), 1, np.float32),
        ((200, 160), 0, np.float32),
        ((33, 70), 1, ml_dtypes.bfloat16),
        ((33, 70), 0, np.float16),
        ((3, 40, 5), 1, ml_dtypes.bfloat16),
        ((2, 3, 64), -1, np.float32),
    ],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_one_copy(shape, axis, dtype, fmt):
    size = int(np.prod(shape))
    x = jnp.asarray(np.resize(CORPUS.reshape(-1), size).reshape(shape).astype(dtype))
    got = jaxmx.quantize(x, fmt, axis, "floor", impl="pallas")
    _same_bytes(got, jaxmx.quantize(x, fmt, axis, "floor", impl="xla"))
    key = jax.random.key(4)
    got = jaxmx.quantize(x, fmt, axis, key=key, impl="pallas")
    _same_bytes(got, jaxmx.quantize(x, fmt, axis, key=key, impl="xla"))


def test_under_jit():
    x = jnp.asarray(_corpus_matrix()[:64, :64])
    run = jax.jit(lambda x: jaxmx.quantize_rowwise_colwise(x, impl="pallas"))
    _same_bytes(run(x), jaxmx.quantize_rowwise_colwise(x, impl="xla"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_lower_to_triton_for_cuda(fmt):
    """Lowered for CUDA, ``impl="pallas"`` is the compiled kernels through Pallas' Triton
    lowering, checked here without a GPU (jax.export lowers for a platform it does not run on).
    Compiling the Triton IR and running it needs a GPU (docs/benchmarks.md)."""
    x = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for fn in (
        lambda x: jaxmx.quantize_rowwise_colwise(x, fmt, impl="pallas", swizzled_scales=True),
        lambda x: jaxmx.quantize_rowwise_colwise(x, fmt, key=jax.random.key(0), impl="pallas"),
        lambda x: jaxmx.quantize(x, fmt, axis=0, impl="pallas"),
        lambda x: jaxmx.quantize(x, fmt, axis=-1, impl="pallas"),
    ):
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton])
        assert "xla.gpu.triton" in exported(x).mlir_module()
    # "auto" is the XLA quantizer until the kernels are measured on a GPU
    exported = jax.export.export(
        jax.jit(lambda x: jaxmx.quantize(x, fmt)), platforms=["cuda"], disabled_checks=[triton]
    )
    assert "xla.gpu.triton" not in exported(x).mlir_module()


def test_bad_impl(monkeypatch):
    x = jnp.ones((4, 32))
    with pytest.raises(ValueError, match="impl"):
        jaxmx.quantize(x, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        jaxmx.quantize_rowwise_colwise(x, impl=None)
    monkeypatch.setattr(quantize_module.jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match="impl='pallas' runs on CUDA GPUs"):
        jaxmx.quantize(x, impl="pallas")
    jaxmx.quantize(x, impl="auto")  # XLA there
