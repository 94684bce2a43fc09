"""The examples in jaxmx's docstrings run and print what they claim."""

import doctest
import importlib
import pkgutil

import pytest

import jaxmx

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(jaxmx.__path__, "jaxmx.")
    if not info.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_the_public_modules_have_examples():
    finder = doctest.DocTestFinder()
    examples = {
        name: sum(len(t.examples) for t in finder.find(importlib.import_module(name)))
        for name in ("jaxmx", "jaxmx.quantize", "jaxmx.dot_general", "jaxmx.matmul")
    }
    assert all(examples.values()), examples
