"""MXArray checks itself: a hand-built one with inconsistent fields raises on first use."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxmx
from jaxmx._src.core.grid_array import GridArray
from jaxmx._src.quantize.fake import quantize_to_grid

BACKENDS = ("emulate", "ffi")


def good():
    return jaxmx.quantize(jnp.ones((8, 64)))


def consumers(backend):
    """Every API that takes an MXArray, as one-argument functions."""
    other = good()
    return [
        lambda q: jaxmx.dequantize(q),
        lambda q: jaxmx.matmul(q, other, jnp.float32, backend=backend),
        lambda q: jaxmx.matmul(other, q, jnp.float32, backend=backend),
    ]


BROKEN = {
    "scales of the wrong shape": (ValueError, lambda q: dataclasses.replace(q, scale=q.scale[:, :1])),  # noqa: E501
    "codes of the wrong shape": (ValueError, lambda q: dataclasses.replace(q, held=q.held[:, :32])),
    "an axis that does not match": (ValueError, lambda q: dataclasses.replace(q, axis=0)),
    "an axis out of range": (ValueError, lambda q: dataclasses.replace(q, axis=2)),
    "a logical shape that disagrees": (ValueError, lambda q: dataclasses.replace(q, shape=(8, 96))),
    "a logical shape of another rank": (ValueError, lambda q: dataclasses.replace(q, shape=(64,))),
    "an unknown format": (ValueError, lambda q: dataclasses.replace(q, fmt="mxfp6")),
    "codes of another format": (TypeError, lambda q: dataclasses.replace(q, fmt="mxfp8_e5m2")),
    "scales that are not E8M0": (
        TypeError,
        lambda q: dataclasses.replace(q, scale=q.scale.view(jnp.uint8).astype(jnp.float32)),
    ),
}  # fmt: skip


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_inconsistent_mxarrays_raise_on_construction(what):
    error, breaks = BROKEN[what]
    with pytest.raises(error, match=r"MXArray|format"):
        breaks(good())


def rebuilt(q, data, scale):
    """``q``'s static fields over other leaves, as a pytree unflatten builds it (unchecked)."""
    return jax.tree.unflatten(jax.tree.structure(q), [data, scale])


BROKEN_LEAVES = {
    "scales of the wrong shape": (ValueError, lambda q: rebuilt(q, q.data, q.scale[:, :1])),
    "codes of the wrong shape": (ValueError, lambda q: rebuilt(q, q.data[:, :32], q.scale)),
    "one row of codes": (ValueError, lambda q: rebuilt(q, q.data[0], q.scale[0])),
    "scales that are not E8M0": (TypeError, lambda q: rebuilt(q, q.data, q.scale.view(jnp.uint8))),
}  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("what", sorted(BROKEN_LEAVES))
def test_inconsistent_leaves_raise_on_every_consumer(backend, what):
    error, breaks = BROKEN_LEAVES[what]
    q = breaks(good())
    for consume in consumers(backend):
        with pytest.raises(error, match="MXArray"):
            consume(q)


def test_one_row_of_codes_for_four_rows_is_refused_but_vmap_still_maps_over_rows():
    q = jaxmx.quantize(jnp.ones((4, 64)))
    with pytest.raises(ValueError, match=r"logical shape \(4, 64\).*got codes \(64,\)"):
        jaxmx.MXArray(q.data[0], q.scale[0], q.fmt, q.axis, (4, 64))
    with pytest.raises(ValueError, match=r"got codes \(64,\)"):
        jaxmx.dequantize(rebuilt(q, q.data[0], q.scale[0]))
    # inside vmap the traced leaves lack the mapped dim: that is accepted
    rows = jax.vmap(jaxmx.dequantize)(q)
    np.testing.assert_array_equal(rows, np.ones((4, 64), np.float32))
    # pytree transforms rebuild MXArrays from leaves that are not arrays: no check there
    assert jax.tree.leaves(jax.tree.map(lambda x: None, q)) == []
    sentinel = object()
    assert jax.tree.leaves(jax.tree.map(lambda x: sentinel, q)) == [sentinel, sentinel]
    assert jax.eval_shape(lambda q: q, q).data.shape == (4, 64)


def test_grid_arrays_check_their_fields():
    g = quantize_to_grid(jnp.ones((4, 64)))
    with pytest.raises(ValueError, match=r"GridArray: .*got codes \(64,\)"):
        GridArray(g.data[0], g.scale[0], g.fmt, g.axis, (4, 64))
    with pytest.raises(TypeError, match="GridArray: an mxfp8_e4m3 GridArray holds float32 values"):
        GridArray(g.data.astype(jnp.bfloat16), g.scale, g.fmt, g.axis, g.shape)


@pytest.mark.parametrize("backend", BACKENDS)
def test_codes_in_the_padding_are_ignored(backend):
    """K = 40 is padded to 64: whatever a hand-built array holds there, the result is the same."""
    rng = np.random.default_rng(0)
    a = jaxmx.quantize(jnp.asarray(rng.standard_normal((8, 40)), jnp.float32))
    b = jaxmx.quantize(jnp.asarray(rng.standard_normal((16, 40)), jnp.float32))
    garbage = a.data.view(jnp.uint8).at[:, 40:].set(0x38).view(a.data.dtype)  # 1.0 codes
    dirty = dataclasses.replace(a, held=garbage)  # MXFP8: the held form is the codes
    clean = jaxmx.matmul(a, b, jnp.float32, backend=backend)
    np.testing.assert_array_equal(jaxmx.matmul(dirty, b, jnp.float32, backend=backend), clean)
    np.testing.assert_array_equal(jaxmx.dequantize(dirty), jaxmx.dequantize(a))
    want = np.asarray(jaxmx.dequantize(a), np.float64) @ np.asarray(jaxmx.dequantize(b)).T
    np.testing.assert_allclose(clean, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_leaves_are_accepted(backend):
    q = good()
    as_numpy = jax.tree.map(np.asarray, q)
    assert isinstance(as_numpy.data, np.ndarray)
    np.testing.assert_array_equal(
        jaxmx.matmul(as_numpy, as_numpy, jnp.float32, backend=backend),
        jaxmx.matmul(q, q, jnp.float32, backend=backend),
    )
    np.testing.assert_array_equal(jaxmx.dequantize(as_numpy), jaxmx.dequantize(q))


def test_vmapped_arrays_with_leading_dims_are_accepted():
    xs = jnp.arange(3 * 4 * 32, dtype=jnp.float32).reshape(3, 4, 32)
    q = jax.vmap(jaxmx.quantize)(xs)  # leaves [3, ...], shape (4, 32)
    assert q.data.shape == (3, 4, 32) and q.shape == (4, 32)
    np.testing.assert_array_equal(jaxmx.dequantize(q), jax.vmap(jaxmx.dequantize)(q))


def test_a_custom_format_object_is_refused_by_quantize_and_dequantize():
    fake = dataclasses.replace(jaxmx.FORMATS["mxfp8_e4m3"], elem_max=240.0)
    with pytest.raises(ValueError, match="custom formats are not supported"):
        jaxmx.quantize(jnp.ones(32), fake)
    # the real Format object is fine, and a name is fine
    q = jaxmx.quantize(jnp.ones(32), jaxmx.FORMATS["mxfp8_e4m3"])
    assert q.fmt == "mxfp8_e4m3"


def test_dequantize_refuses_output_dtypes_that_cannot_hold_nan():
    q = jaxmx.quantize(jnp.array([np.nan] + [1.0] * 31))
    for dtype in (jnp.int8, jnp.bool_, jnp.float8_e4m3fn, ml_dtypes.float8_e5m2):
        with pytest.raises(TypeError, match="dequantize: dtype"):
            jaxmx.dequantize(q, dtype)
    assert np.isnan(np.asarray(jaxmx.dequantize(q, jnp.bfloat16), np.float32)[0])


def test_a_negative_axis_counts_from_the_end_and_asarray_points_to_dequantize():
    q = jaxmx.quantize(jnp.ones((4, 64)), "mxfp8_e4m3", axis=-1)
    assert jaxmx.MXArray(q.data, q.scale, q.fmt, -1, (4, 64)).axis == 1
    with pytest.raises(ValueError, match="axis -3 is not an axis of shape"):
        jaxmx.MXArray(q.data, q.scale, q.fmt, -3, (4, 64))
    with pytest.raises(TypeError, match=r"jaxmx.dequantize\(q\) gives the array"):
        jnp.asarray(q)
