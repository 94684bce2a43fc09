"""Recipe's construction rules, and the checkers the entry points share with it."""

import re

import jax.numpy as jnp
import pytest

import jaxmx
from jaxmx._src.core.recipes import check_accumulation, check_recipe


def test_recipe_fields_are_keyword_only():
    with pytest.raises(TypeError, match="positional"):
        jaxmx.Recipe("mxfp8_e4m3")
    assert jaxmx.Recipe(fwd="mxfp8_e4m3") == jaxmx.recipes.MXFP8


def test_check_recipe_names_the_caller_and_the_argument():
    assert check_recipe(jaxmx.recipes.MXFP8, "f") is jaxmx.recipes.MXFP8
    assert check_recipe(None, "f", optional=True) is None
    with pytest.raises(TypeError, match=r"^f: recipe must be a jaxmx\.Recipe .*, got None$"):
        check_recipe(None, "f")
    with pytest.raises(TypeError, match=r"^f: keep_recipe must be .* or None .*, got 'x'$"):
        check_recipe("x", "f", name="keep_recipe", optional=True)


@pytest.mark.parametrize(
    "call, where",
    [
        (lambda x: jaxmx.einsum("ij,kj->ik", x, x, recipe="mxfp8"), "jaxmx.einsum"),
        (
            lambda x: jaxmx.dot_product_attention(x[None], x[None], x[None], recipe="mxfp8"),
            "jaxmx.dot_product_attention",
        ),
    ],
)
def test_entry_points_name_themselves_for_a_bad_recipe(call, where):
    x = jnp.ones((32, 32))
    with pytest.raises(TypeError, match=re.escape(f"{where}: recipe must be a jaxmx.Recipe")):
        call(x)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(promote_every=128), "promote_every needs accum_bits"),
        (dict(accum_bits=24), r"accum_bits must be an integer in \[1, 18\]"),
        (dict(accum_bits=14, promote_every=100), "positive multiple of 32"),
        (dict(accum_bits=14, backend="ffi"), "emulation only; backend 'ffi' cannot take it"),
        (
            dict(accum_bits=14, fwd="nvfp4", grad="nvfp4", scale_mode="e4m3"),
            "accum_bits models MX GEMMs only, got nvfp4 x nvfp4",
        ),
    ],
)
def test_recipe_and_check_accumulation_raise_the_same_messages(settings, message):
    with pytest.raises(ValueError, match=message) as from_recipe:
        jaxmx.Recipe(**settings)
    formats = (settings.get("fwd", "mxfp8_e4m3"), settings.get("grad", "mxfp8_e4m3"))
    args = (settings.get("accum_bits"), settings.get("promote_every"), formats)
    with pytest.raises(ValueError, match=message) as direct:
        check_accumulation(*args, settings.get("backend", "auto"), "Recipe")
    assert str(from_recipe.value) == str(direct.value)


def test_check_accumulation_returns_the_accumulator():
    got = check_accumulation(14, 128, ("mxfp8_e4m3", "mxfp8_e5m2"), "emulate", "f")
    assert got == (14, 128) and jaxmx.Recipe(accum_bits=14, promote_every=128).accumulation == got
    assert check_accumulation(None, None, ("fp8_e4m3_block",), "ffi", "f") is None


def test_check_accumulation_refuses_an_unknown_backend_as_check_backend_does():
    with pytest.raises(ValueError, match="unknown backend 'cublas'"):
        check_accumulation(14, None, ("mxfp8_e4m3",), "cublas", "jaxmx.matmul")


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            dict(fwd="nvfp4", grad="nvfp4", scale_mode="e4m3"),
            "nvfp4 has no E8M0 scales .*, and so has nvfp4",
        ),
        (
            dict(fwd="fp8_e4m3_block", grad="fp8_e4m3_block", scale_mode="pow2"),
            "fp8_e4m3_block has no E8M0 scales",
        ),
        (dict(backend="ffi"), "backend='ffi' is exact"),
        (dict(backend="xla"), "backend='xla' is exact"),
        (dict(accum_bits=14), "accum_bits models the accumulator"),
    ],
)
def test_exact_emulation_is_refused_where_it_would_do_nothing(settings, message):
    with pytest.raises(ValueError, match=f"exact_emulation=True would do nothing: {message}"):
        jaxmx.Recipe(exact_emulation=True, **settings)


def test_exact_emulation_takes_a_bool():
    with pytest.raises(TypeError, match="exact_emulation must be True or False, got 1"):
        jaxmx.Recipe(exact_emulation=1)
    assert jaxmx.recipes.MXFP8_HYBRID.replace(exact_emulation=True).exact_emulation


def test_ragged_dot_refuses_exact_emulation():
    with pytest.raises(NotImplementedError, match="exact_emulation is not available for grouped"):
        jaxmx.grouped_recipe(jaxmx.recipes.MXFP8.replace(exact_emulation=True))
