"""The public surface: public modules import, and every ``jaxmx.…`` name in the docs resolves."""

import ast
import importlib
import pathlib
import re
import subprocess
import sys

import pytest

import jaxmx

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PUBLIC_MODULES = ["jaxmx", "jaxmx.recipes", "jaxmx.ffi", "jaxmx.diagnostics", "jaxmx.flax",
                  "jaxmx.flax.linen", "jaxmx.flax.nnx"]  # fmt: skip
NAME = re.compile(r"\bjaxmx(?:\.[A-Za-z_]\w*)+")


def resolve(dotted: str):
    """The object a dotted name refers to: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def doc_names() -> list[tuple[str, str]]:
    found = set()
    for path in DOCS:
        for name in NAME.findall(path.read_text()):
            found.add((path.name, name.rstrip(".")))
    return sorted(found)


def test_the_docs_name_jaxmx_apis():
    assert len(doc_names()) > 20


@pytest.mark.parametrize(("doc", "name"), doc_names())
def test_every_name_in_the_docs_resolves(doc, name):
    try:
        resolve(name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{doc} names {name}, which does not resolve: {e}")


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_public_modules_import_and_export_what_they_list(name):
    module = importlib.import_module(name)
    for attr in module.__all__:
        assert getattr(module, attr) is not None


def test_public_names_are_not_shadowed_modules():
    # `jaxmx.quantize` and friends are the functions; no module of that name hides behind them
    for name in ("quantize", "dequantize", "dot_general", "einsum", "matmul"):
        assert callable(getattr(jaxmx, name))
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"jaxmx.{name}")


def test_the_top_level_exports_the_documented_api():
    expected = {
        "quantize", "dequantize", "quantize_rowwise_colwise", "swizzle_scales",
        "unswizzle_scales", "dot_general", "einsum", "matmul", "MXArray", "Recipe", "recipes",
        "backends", "stochastic_rounding", "BlockShardingError", "LHS_COLWISE", "RHS_COLWISE",
        "LHS_INPUT", "RHS_INPUT", "KVCache", "cached_attention", "expert_parallel_ffn",
        "fsdp_dot_general", "store_weight", "weight_matmul",
    }  # fmt: skip
    assert expected <= set(jaxmx.__all__)


def test_one_version_string():
    from importlib.metadata import version

    assert version("jaxmx") == jaxmx.__version__


@pytest.mark.parametrize(
    ("old", "new"), [("NATIVE_FORMATS", "MXFP8_FORMATS"), ("cublaslt_supported", "mx_supported")]
)
def test_renamed_ffi_names_keep_their_old_names(old, new):
    assert getattr(jaxmx.ffi, old) is getattr(jaxmx.ffi, new)
    assert {old, new} <= set(jaxmx.ffi.__all__)


def test_import_jaxmx_loads_no_jax_until_a_name_is_used():
    code = (
        "import sys, jaxmx\n"
        "assert 'jax' not in sys.modules, 'import jaxmx'\n"
        "from jaxmx import FORMATS, BACKENDS, SAVE_FORMATS\n"
        "assert 'jax' not in sys.modules, 'the format and backend names'\n"
        "assert callable(jaxmx.quantize) and 'jax' in sys.modules\n"
        "assert jaxmx.__dict__['quantize'] is jaxmx.quantize  # kept after the first use\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_lazy_names_are_the_type_checking_imports_and_all():
    """Each public name loads from the module its ``TYPE_CHECKING`` import (what type checkers
    and the layer test read) names, and ``__all__`` lists exactly those names."""
    tree = ast.parse(pathlib.Path(jaxmx.__file__).read_text())
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    )
    imported = {alias.name: node.module for node in block.body for alias in node.names}
    submodules = {n for n, m in imported.items() if m == "jaxmx"}
    assert submodules == set(jaxmx._SUBMODULES)
    assert {n: m for n, m in imported.items() if m != "jaxmx"} == jaxmx._SOURCES
    assert set(jaxmx.__all__) == {*imported, "__version__"}
    assert set(jaxmx.__all__) <= set(dir(jaxmx))


def test_an_unknown_top_level_name_is_the_usual_attribute_error():
    with pytest.raises(AttributeError, match=r"^module 'jaxmx' has no attribute 'quantise'$"):
        jaxmx.quantise  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'quantise' from 'jaxmx'"):
        from jaxmx import quantise  # noqa: F401
