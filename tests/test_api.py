"""The public surface: public modules import, and every ``jaxmx.…`` name in the docs resolves."""

import importlib
import pathlib
import re

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
        "fsdp_dot_general",
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
