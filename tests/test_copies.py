"""quantize_rowwise_colwise's named results: Copies (2 items) and SwizzledCopies (4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmx
from jaxmx._src.core.copies import as_copies


def test_the_types_are_exported_and_named():
    assert jaxmx.Copies._fields == ("row", "col_t")
    assert jaxmx.SwizzledCopies._fields == ("row", "col_t", "row_swizzled", "col_t_swizzled")
    assert {"Copies", "SwizzledCopies"} <= set(jaxmx.__all__)


def test_as_copies_picks_the_type_by_length():
    assert type(as_copies((1, 2))) is jaxmx.Copies
    four = as_copies((1, 2, 3, 4))
    assert type(four) is jaxmx.SwizzledCopies and four.copies == (1, 2) == four[:2]
    with pytest.raises(ValueError, match=r"as_copies: expected \(row, col_t\) .* got 3 items"):
        as_copies((1, 2, 3))


def test_named_tuples_are_pytrees_through_jit():
    got = jax.jit(lambda x: jaxmx.SwizzledCopies(x, x + 1, x + 2, x + 3))(jnp.zeros(2))
    assert type(got) is jaxmx.SwizzledCopies and got.col_t_swizzled.tolist() == [3.0, 3.0]


def test_quantize_rowwise_colwise_returns_copies():
    x = jax.random.normal(jax.random.key(0), (64, 96))
    copies = jaxmx.quantize_rowwise_colwise(x)
    assert type(copies) is jaxmx.Copies
    row, col_t = copies  # the 2-tuple unpacking keeps working
    assert copies.row is row and copies.col_t is col_t
    assert row.shape == (64, 96) and col_t.shape == (96, 64)


def test_quantize_rowwise_colwise_returns_swizzled_copies():
    x = jax.random.normal(jax.random.key(0), (64, 96))
    got = jaxmx.quantize_rowwise_colwise(x, swizzled_scales=True)
    assert type(got) is jaxmx.SwizzledCopies
    row, col_t, row_sw, col_sw = got  # the 4-tuple unpacking keeps working
    plain = jaxmx.quantize_rowwise_colwise(x)
    assert type(got.copies) is jaxmx.Copies
    for a, b in zip(jax.tree.leaves(got.copies), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got.row_swizzled, jaxmx.swizzle_scales(row.scale))
    np.testing.assert_array_equal(got.col_t_swizzled, jaxmx.swizzle_scales(col_t.scale))
    assert row_sw is got.row_swizzled and col_sw is got.col_t_swizzled


def test_the_names_survive_jit():
    got = jax.jit(lambda x: jaxmx.quantize_rowwise_colwise(x, swizzled_scales=True))(
        jnp.ones((64, 96))
    )
    assert type(got) is jaxmx.SwizzledCopies and got.col_t.shape == (96, 64)
