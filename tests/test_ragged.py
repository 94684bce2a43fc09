"""jaxmx.ragged_dot: the MX definition of each GEMM (numpy reference) and jax.lax.ragged_dot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import jaxmx

SIZES = np.array([0, 1, 31, 33, 100])  # group sizes; 5 more rows past the last group
M, K, N = int(SIZES.sum()) + 5, 64, 48


def qdq(x, axis):
    """x quantized to MXFP8 E4M3 (rceil) along ``axis`` and decoded, by tests/reference.py."""
    x = np.asarray(x, np.float32)
    data, scale = ref.quantize(x, "mxfp8_e4m3", "rceil", axis=axis)
    return ref.dequantize(data, scale, axis, x.shape)


def groups(sizes):
    """(start, stop) of each group's rows."""
    ends = np.cumsum(sizes)
    return list(zip(ends - sizes, ends, strict=True))


def inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(keys[0], (M, K))
    rhs = jax.random.normal(keys[1], (len(SIZES), K, N)) * K**-0.5
    g = jax.random.normal(keys[2], (M, N))
    return lhs, rhs, g


def reference_vjp(lhs, rhs, g, sizes):
    """Each GEMM from its own MX copies: out and dlhs row by row, drhs group by group (each
    group's tokens quantized along M on their own, zero-padded to whole blocks)."""
    out, dlhs = np.zeros((M, N)), np.zeros((M, K))
    drhs = np.zeros((len(sizes), K, N))
    lq, gq = qdq(lhs, 1), qdq(g, 1)
    for j, (a, b) in enumerate(groups(sizes)):
        out[a:b] = lq[a:b] @ qdq(rhs[j], 0)
        dlhs[a:b] = gq[a:b] @ qdq(rhs[j], 1).T
        if b > a:
            drhs[j] = qdq(lhs[a:b], 0).T @ qdq(g[a:b], 0)
    return out, dlhs, drhs


def mx_vjp(lhs, rhs, g, sizes):
    @jax.jit
    def run(lhs, rhs, g, sizes):  # group sizes traced
        out, pullback = jax.vjp(lambda a, b: jaxmx.ragged_dot(a, b, sizes), lhs, rhs)
        return (out, *pullback(g))

    return run(lhs, rhs, g, jnp.asarray(sizes))


def test_every_gemm_is_the_mx_definition():
    lhs, rhs, g = inputs()
    for got, want in zip(
        mx_vjp(lhs, rhs, g, SIZES), reference_vjp(lhs, rhs, g, SIZES), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_matches_lax_ragged_dot_to_mxfp8_accuracy():
    lhs, rhs, g = inputs(1)
    sizes = jnp.asarray(SIZES)
    want_out, pullback = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), lhs, rhs)
    want = (want_out, *pullback(g))
    got = mx_vjp(lhs, rhs, g, SIZES)
    assert np.all(np.asarray(got[0])[int(SIZES.sum()) :] == 0)  # rows past the last group
    for a, b in zip(got, want, strict=True):
        err = np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
        assert 1e-3 < err < 0.08


def test_weight_gradient_blocks_never_mix_groups():
    """One group's tokens scaled by 2^20: every other group's weight gradient is unchanged (a
    block spanning two groups would take its scale from the large group)."""
    lhs, rhs, g = inputs(2)
    start, stop = groups(SIZES)[3]
    scaled = lhs.at[start:stop].multiply(2.0**20)
    base, loud = mx_vjp(lhs, rhs, g, SIZES)[2], mx_vjp(scaled, rhs, g, SIZES)[2]
    for j in (0, 1, 2, 4):
        np.testing.assert_array_equal(base[j], loud[j])
    assert not np.array_equal(base[3], loud[3])


def test_bad_inputs():
    lhs, rhs, _ = inputs()
    sizes = jnp.asarray(SIZES)
    with pytest.raises(NotImplementedError, match="no native grouped MX GEMM"):
        jaxmx.ragged_dot(lhs, rhs, sizes, recipe=jaxmx.recipes.MXFP8.replace(backend="ffi"))
    with pytest.raises(NotImplementedError, match=r"Recipe\.rht .* not available"):
        jaxmx.ragged_dot(lhs, rhs, sizes, recipe=jaxmx.recipes.MXFP8.replace(rht=True))
    with pytest.raises(ValueError, match=r"rhs \[g, k, n\] with the same k"):
        jaxmx.ragged_dot(lhs, rhs[:, :32], sizes)
    with pytest.raises(ValueError, match="group_sizes must be"):
        jaxmx.ragged_dot(lhs, rhs, sizes[:3])
    with pytest.raises(ValueError, match="group_sizes must be"):
        jaxmx.ragged_dot(lhs, rhs, sizes.astype(jnp.float32))


def test_the_docs_moe_layer_trains():
    """The nnx MoE layer of docs/flax.md runs as written and its grouped GEMMs are jaxmx's."""
    import pathlib
    import re

    doc = pathlib.Path(__file__).resolve().parent.parent / "docs" / "flax.md"
    block = next(b for b in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S) if "MoE" in b)
    scope: dict = {}
    exec(compile(block, str(doc), "exec"), scope)
    moe, x, grads = scope["moe"], scope["x"], scope["grads"]
    assert np.isfinite(float(scope["loss"]))
    for name in ("w_in", "w_out", "router"):
        leaves = jax.tree.leaves(getattr(grads, name))
        assert leaves and all(np.all(np.isfinite(v)) and np.any(v != 0) for v in leaves)
    assert str(jax.make_jaxpr(lambda x: moe(x))(x)).count("custom_vjp_call") == 2
