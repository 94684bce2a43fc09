"""jaxmx.einsum's subscript parser: ellipsis, implicit output, summed and batch indices, errors."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxmx
from jaxmx._src.training.einsum import _parse

EMULATE = jaxmx.recipes.MXFP8.replace(backend="emulate")


@pytest.mark.parametrize(
    ("spec", "ranks", "parsed"),
    [
        ("md,nd->mn", (2, 2), ("md", "nd", "mn")),
        ("md,nd", (2, 2), ("md", "nd", "mn")),  # implicit: indices seen once, alphabetically
        ("nd,md", (2, 2), ("nd", "md", "mn")),
        ("bmd,bnd->bmn", (3, 3), ("bmd", "bnd", "bmn")),
        ("...d,nd->...n", (4, 2), ("ABCd", "nd", "ABCn")),  # ellipsis aligned from the right
        ("...d,...d->...", (3, 2), ("ABd", "Bd", "AB")),
        ("...d,nd", (3, 2), ("ABd", "nd", "ABn")),  # implicit output keeps the ellipsis first
        (" b t d , d h -> b t h ", (3, 2), ("btd", "dh", "bth")),
    ],
)
def test_parse(spec, ranks, parsed):
    lhs, rhs, out = _parse(spec, *ranks)
    assert ("".join(lhs), "".join(rhs), "".join(out)) == parsed


@pytest.mark.parametrize(
    ("spec", "ranks", "message"),
    [
        ("ij,jk,kl", (2, 2), "exactly two operands"),
        ("ij->i", (2, 2), "exactly two operands"),
        ("ijk,jk->ik", (2, 2), "do not match rank"),
        ("ii,ij->j", (2, 2), "repeated index"),
        ("ij,jk->iz", (2, 2), "invalid output"),
        ("ij,jk->ii", (2, 2), "invalid output"),
        ("i1,1k->ik", (2, 2), "do not match rank"),
    ],
)
def test_parse_errors(spec, ranks, message):
    with pytest.raises(ValueError, match=message):
        _parse(spec, *ranks)


def test_a_summed_index_that_only_one_operand_has():
    """``s`` appears only in the lhs and not in the output: summed out before the GEMM."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-2, 3, (3, 4, 32)), jnp.float32)  # exact in E4M3
    w = jnp.asarray(rng.integers(-2, 3, (5, 32)), jnp.float32)
    got = jaxmx.einsum("sbd,nd->bn", x, w, recipe=EMULATE)
    want = np.einsum("sbd,nd->bn", np.asarray(x, np.float64), np.asarray(w, np.float64))
    np.testing.assert_allclose(got, want, rtol=2**-7)  # sum of 3 copies re-quantized


def test_batch_and_ellipsis_match_jnp_einsum():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.integers(-3, 4, (2, 3, 4, 32)), jnp.float32)  # exact in E4M3
    w = jnp.asarray(rng.integers(-3, 4, (2, 6, 32)), jnp.float32)
    for spec in ("bsmd,bnd->bsmn", "b...d,bnd->b...n", "bsmd,bnd"):
        got = jaxmx.einsum(spec, x, w, recipe=EMULATE, preferred_element_type=jnp.float32)
        np.testing.assert_array_equal(got, jnp.einsum(spec, x, w))


def test_non_array_operands_are_refused():
    with pytest.raises(TypeError):
        jaxmx.einsum("ij,jk->ik", None, jnp.ones((2, 2)))
