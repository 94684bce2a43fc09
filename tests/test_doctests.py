"""The examples in jaxmx's docstrings run and print what they claim."""

import doctest
import importlib
import pkgutil

import pytest

import jaxmx

PACKAGES = list(pkgutil.walk_packages(jaxmx.__path__, "jaxmx."))
MODULES = sorted(info.name for info in PACKAGES if not info.name.endswith("__main__"))


# the compiled extension, a version string and the private layers' docstring-only __init__ files
LAYERS = tuple(info.name for info in PACKAGES if info.ispkg and info.name.startswith("jaxmx._src"))
WITHOUT_CODE = ("jaxmx._ffi", "jaxmx._version", *LAYERS)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_every_module_has_examples():
    finder = doctest.DocTestFinder()
    examples = {
        name: sum(len(t.examples) for t in finder.find(importlib.import_module(name)))
        for name in [*MODULES, "jaxmx"]
        if not name.startswith("jaxmx.demo") and name not in WITHOUT_CODE
    }
    assert all(examples.values()), [name for name, n in examples.items() if not n]
