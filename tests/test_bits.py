"""The integer fp8 codec of jaxmx._bits against ml_dtypes, exhaustively over codes and ties."""

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxmx._src.core import bits as _bits

FORMATS = [  # (dtype, mbits, emin, ieee specials, max)
    (ml_dtypes.float8_e4m3fn, 3, -6, False, 448.0),
    (ml_dtypes.float8_e5m2, 2, -14, True, 57344.0),
]


@pytest.mark.parametrize("dtype, mbits, emin, ieee, top", FORMATS)
def test_decode_every_code(dtype, mbits, emin, ieee, top):
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(dtype).astype(np.float32)
    got = np.asarray(jax.jit(lambda c: _bits.decode_fp8(c, mbits, emin, ieee))(codes))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))


@pytest.mark.parametrize("dtype, mbits, emin, ieee, top", FORMATS)
def test_encode_matches_ml_dtypes_on_grid_points_ties_and_random_values(
    dtype, mbits, emin, ieee, top
):
    grid = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    grid = np.unique(grid[np.isfinite(grid) & (np.abs(grid) <= top)])
    ties = (grid[1:] + grid[:-1]) / 2  # exactly halfway: round to the even code
    rng = np.random.default_rng(0)
    random = rng.uniform(-top, top, 100_000) * 2.0 ** rng.integers(-30, 1, 100_000)
    values = np.concatenate([grid, ties, random]).astype(np.float32)
    values = np.concatenate([values, np.nextafter(values, np.inf), np.nextafter(values, -np.inf)])
    values = np.clip(values, -top, top).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: _bits.encode_fp8(v, mbits, emin))(values))
    np.testing.assert_array_equal(got, values.astype(dtype).view(np.uint8))
    nan = np.asarray(jax.jit(lambda v: _bits.encode_fp8(v, mbits, emin))(np.float32([np.nan])))
    assert np.isnan(nan.view(dtype).astype(np.float32)).all()
