"""``materialized``: the array bit for bit, held by XLA as it is (not as what it came from)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxmx._src.core.materialize import materialized, tied

_DTYPES = [jnp.float8_e4m3fn, jnp.float8_e8m0fnu, jnp.uint8, jnp.int8, jnp.bfloat16, jnp.int32]


@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
    "source", [np.float32(-0.0), np.array([[255]], np.uint8), np.array([np.nan], np.float32)]
)
def test_every_bit_pattern_comes_back(dtype, source):
    width = jnp.dtype(dtype).itemsize * 8
    patterns = (
        np.arange(256, dtype=np.uint8)
        if width == 8
        else np.array(
            [0, 1, 2**width - 1, 2 ** (width - 1), 2 ** (width - 1) + 1, 0x7FC1 % 2**width]
        ).astype(f"uint{width}")
    )
    floating = jnp.issubdtype(dtype, jnp.floating)
    x = patterns.view(ml_dtypes.finfo(dtype).dtype if floating else dtype)
    out = jax.jit(materialized)(jnp.asarray(x), one_from=jnp.asarray(source))
    np.testing.assert_array_equal(np.asarray(out).view(f"uint{width}"), patterns)


def test_refuses_sub_byte_and_wide_elements():
    for dtype in (jnp.float4_e2m1fn, jnp.float64 if jax.config.x64_enabled else jnp.int4):
        with pytest.raises(TypeError, match="8, 16 or 32-bit"):
            materialized(jnp.zeros(4, dtype), one_from=jnp.ones(1))


def test_empty_arrays_pass_through():
    assert materialized(jnp.zeros((0, 3), jnp.uint8), one_from=jnp.ones(1)).shape == (0, 3)


def _codes_read_twice(hold: bool) -> int:
    """Temporary bytes of a program whose 8-bit codes ``convert(x / s)`` (512 x 512) are read
    by two GEMMs, the second after the first's result is used, held with ``materialized``
    (``hold``) or as XLA chooses."""

    def f(x, s, w):
        codes = (x / s).astype(jnp.float8_e4m3fn)
        if hold:
            codes = materialized(codes, one_from=s)
        y = jnp.tanh((codes.astype(jnp.float32) * s) @ w) @ w
        return (codes.astype(jnp.float32) * y) @ w

    x = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    s = jax.ShapeDtypeStruct((), jnp.float32)
    compiled = jax.jit(f).lower(x, s, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_codes_read_twice_are_held_as_codes():
    # One float32 512 x 512 temporary (1 MiB) at a time, beside what holds the codes: the
    # float32 quotients (1 MiB) as XLA chooses, the codes (256 KiB) when told.
    mib = 2**20
    assert _codes_read_twice(hold=False) >= 2 * mib
    assert _codes_read_twice(hold=True) <= mib + mib // 4 + mib // 16


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint16, jnp.uint32])
@pytest.mark.parametrize("to", [np.float32(-0.0), np.float32(np.nan), np.array([[-3]], np.int32)])
def test_tied_values_are_the_values(dtype, to):
    width = jnp.dtype(dtype).itemsize * 8
    v = np.array([0, 1, 2 ** (width - 1), 2**width - 1, 0x5A5A5A5A % 2**width], dtype)
    np.testing.assert_array_equal(jax.jit(tied)(jnp.asarray(v), to=jnp.asarray(to)), v)
    np.testing.assert_array_equal(tied(jnp.asarray(v), to=jnp.zeros((0,))), v)
