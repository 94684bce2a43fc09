"""The repository's examples/ as importable modules, for the tests that run them."""

import importlib
import pathlib
import sys

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"


def load_example(name: str):
    """The module ``examples/<name>.py`` (examples import each other by name, so the folder goes
    on ``sys.path``)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)
