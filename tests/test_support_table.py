"""One table of what each format supports (``jaxmx._src.core.support``): the docs print it and
the refusals read it."""

import pathlib
import re

import jax.numpy as jnp
import pytest

import jaxmx
from jaxmx._src.core import support

DOCS = pathlib.Path(__file__).parent.parent / "docs" / "quantization.md"


def test_the_docs_print_the_table():
    text = DOCS.read_text()
    assert support.support_table() in text, "docs/quantization.md: regenerate the support table"


def test_every_format_and_feature_is_in_the_table():
    rows = support.support_table().split("\n\n")[0].splitlines()[2:]
    assert [re.match(r"\| `([^`]+)`", r).group(1) for r in rows] == list(jaxmx.FORMATS)
    assert all(r.count("|") == len(support.FEATURES) + 2 for r in rows)
    assert support.support_table().count("\n- ") == len(support.FEATURES)


@pytest.fixture
def without_tiles(monkeypatch):
    """The table edited to say MXFP8 has no tiles: the refusals must follow it."""
    feature = support.FEATURES["tiles"]
    refused = lambda f: "no tiles in this test" if f.name == "mxfp8_e4m3" else feature.missing(f)
    monkeypatch.setitem(
        support.FEATURES,
        "tiles",
        support.Feature(title=feature.title, what=feature.what, missing=refused),
    )


def test_the_refusals_read_the_table(without_tiles):
    x = jnp.ones((32, 64))
    with pytest.raises(ValueError, match="mxfp8_e4m3 has no tiles in this test"):
        jaxmx.quantize(x, "mxfp8_e4m3", tile=(32, 32))
    with pytest.raises(ValueError, match="no tiles in this test"):
        jaxmx.Recipe(fwd="mxfp8_e4m3", grad="mxfp8_e4m3", weight_tile=(32, 32))
    jaxmx.quantize(x, "mxfp8_e5m2", tile=(32, 32))  # the others as the table says


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: jaxmx.quantize(jnp.ones((4, 64)), "fp8_e4m3_row", tile=(4, 32)), "per row"),
        (lambda: jaxmx.quantize(jnp.ones((4, 64)), "e5m6_block", impl="pallas"), "12-bit codes"),
        (lambda: jaxmx.KVCache.create(1, 8, 2, 32, fmt="fp8_e4m3_tensor"), "per tensor"),
        (lambda: jaxmx.KVCache.create(1, 8, 2, 32, fmt="e5m6_block"), "storage-only"),
    ],
)
def test_a_missing_feature_is_refused_with_the_tables_reason(call, match):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        call()
