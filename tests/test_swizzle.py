"""The cuBLAS 128x4 scale layout (jaxmx.swizzle_scales / unswizzle_scales) against the formula.

The reference is tests/reference.py's per-index offset function and a few offsets worked out by
hand, never jaxmx itself.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference as ref

import jaxmx


def codes(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("shape", [(1, 1), (130, 5), (256, 8), (3, 129, 7), (2, 2, 4, 3)])
def test_swizzle_matches_reference_formula(shape):
    rng = np.random.default_rng(0)
    s = rng.integers(1, 256, shape, dtype=np.uint8)  # no zeros, so padding is visible
    buf = np.asarray(jax.jit(jaxmx.swizzle_scales)(jnp.asarray(s)))
    want = ref.swizzle(s)
    assert buf.dtype == np.uint8 and buf.shape == want.shape
    np.testing.assert_array_equal(buf, want)
    rows, cols = shape[-2:]
    assert (buf != 0).sum() == s.size  # every padding byte is zero
    # E8M0 (and E4M3) input gives the same bytes
    e8 = jnp.asarray(s.view(ml_dtypes.float8_e8m0fnu))
    np.testing.assert_array_equal(np.asarray(jaxmx.swizzle_scales(e8)), want)
    e4 = jnp.asarray(s.view(ml_dtypes.float8_e4m3fn))  # NVFP4's block scales
    np.testing.assert_array_equal(np.asarray(jaxmx.swizzle_scales(e4)), want)
    # unswizzle: inverse, and the reference's gather
    unsw = jax.jit(jaxmx.unswizzle_scales, static_argnums=(1, 2))(jnp.asarray(buf), rows, cols)
    assert unsw.dtype == jnp.float8_e8m0fnu and unsw.shape == shape
    np.testing.assert_array_equal(codes(unsw), s)
    np.testing.assert_array_equal(ref.unswizzle(want, rows, cols), s)
    back = jaxmx.unswizzle_scales(jnp.asarray(buf), rows, cols, dtype=jnp.float8_e4m3fn)
    assert back.dtype == jnp.float8_e4m3fn  # NVFP4's scales round-trip in their own dtype
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8), s)


def test_swizzle_spot_offsets():
    """A few offsets written out by hand from the cuBLAS layout formula."""
    s = np.zeros((130, 5), np.uint8)
    s[0, 0], s[1, 0], s[32, 0], s[0, 3], s[0, 4], s[129, 4], s[33, 1] = 1, 2, 3, 4, 5, 6, 7
    buf = np.asarray(jaxmx.swizzle_scales(jnp.asarray(s)))
    assert buf.shape == (256 * 8,)
    # Cp = 8: off = ((r//128)*2 + c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4
    expected = {0: 1, 16: 2, 4: 3, 3: 4, 512: 5, 1024 + 512 + 16: 6, 16 + 4 + 1: 7}
    assert {int(i): int(buf[i]) for i in np.nonzero(buf)[0]} == expected


def test_swizzle_errors():
    with pytest.raises(ValueError):
        jaxmx.swizzle_scales(jnp.zeros((4,), jnp.uint8))
    with pytest.raises(TypeError):
        jaxmx.swizzle_scales(jnp.zeros((4, 4), jnp.int32))
    with pytest.raises(ValueError):
        jaxmx.unswizzle_scales(jnp.zeros((100,), jnp.uint8), 4, 4)
    with pytest.raises(TypeError, match="dtype"):
        jaxmx.unswizzle_scales(jnp.zeros((512,), jnp.uint8), 4, 4, dtype=jnp.float32)


@pytest.mark.parametrize("rows, cols, name", [(-3, 0, "rows"), (-128, 4, "rows"), (2, -4, "cols")])
def test_unswizzle_rejects_negative_sizes(rows, cols, name):
    """A negative size is refused by name, even where its padded byte count matches the buffer."""
    with pytest.raises(ValueError, match=f"unswizzle_scales: {name} must be non-negative"):
        jaxmx.unswizzle_scales(jnp.zeros((0,), jnp.uint8), rows, cols)


def test_unswizzle_of_an_empty_matrix():
    assert jaxmx.unswizzle_scales(jnp.zeros((0,), jnp.uint8), 2**62, 0).shape == (2**62, 0)
