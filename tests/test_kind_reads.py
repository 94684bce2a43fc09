"""Where the package branches on a format's kind, checked from its source (docs/architecture.md).

A format's kind (its scale kind, span, element coding, tensor scale, ...) decides behaviour in
the format table (``core/formats.py``), the scale rules (``quantize/scales.py``: one object per
scale kind), the support table (``core/support.py``) and the dispatcher (``gemm/dispatch.py``);
the element codecs (``quantize/codec.py``) are chosen by ``Format.coding`` without a condition.
Elsewhere a condition that reads one (``if f.span == "row"``, ``x if
f.is_mx else y``) is allowed only where :data:`ALLOWED` lists it, with the reason it is not a
method of one of those objects. A new branch on a kind fails here: give the object a method
(or the support table a feature) instead, or list it with its reason.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import textwrap

SRC = pathlib.Path(__file__).resolve().parent.parent / "jaxmx" / "_src"

KIND_ATTRIBUTES = frozenset(
    {
        "is_mx",
        "span",
        "has_global_scale",
        "is_integer",
        "scale_kind",
        "pow2",
        "pow2_twin",
        "has_block_statistics",
        "block_statistics",
        "gemm_operand",
        "has_inf",
        "coding",
        "has_grid_values",
    }
)
"""Attributes of a Format (or of its ScaleKind) that name its kind."""

WHERE_KINDS_DECIDE = frozenset(
    {
        "core/formats.py",
        "core/support.py",
        "quantize/scales.py",
        "gemm/dispatch.py",
    }
)

ALLOWED = {
    "core/blocks.py": (2, "the definition of a scale's group: a block, a row or the tensor"),
    "core/mxarray.py": (1, "the constructor checks a tensor scale against the format"),
    "core/mxarray_layouts.py": (1, "only a per-tensor quantization serves every axis"),
    "core/recipes.py": (3, "a recipe's pair of formats: one scale kind and block, accum_bits"),
    "quantize/quantize.py": (2, "a per-tensor scale is broadcast, and serves both copies"),
    "quantize/fake.py": (2, "grid values exist for MX and NVFP4; the float32 shortcut for MX"),
    "quantize/nvfp4.py": (1, "a global_scale argument is NVFP4's and refused for others"),
    "quantize/pow2_blocks.py": (1, "the table of block FP8 formats with an MX twin"),
    "gemm/blockwise.py": (3, "E8M0 rows are decoded relative to their largest scale"),
    "gemm/emulate.py": (1, "only E8M0 operands have row exponents to restore"),
    "gemm/scaled_dot.py": (1, "only E8M0 operands have row exponents to restore"),
    "gemm/capabilities.py": (1, "a GEMM family takes operands of one scale kind"),
    "gemm/native/operands.py": (2, "block alignment for block scales; one scale kind a pair"),
    "gemm/native/current_fp8.py": (1, "a per-tensor pair takes the scalar-factor GEMM"),
    "training/contract.py": (1, "only 1-D block formats are tiled per shard"),
    "training/fsdp.py": (1, "a per-tensor weight has no blocks to align with its shards"),
    "serving/kv_cache.py": (1, "an NVFP4 cache keeps its fixed tensor scale"),
    "serving/kv_checks.py": (1, "a storage-only format's refusal names why"),
    "diagnostics/levels.py": (2, "a level's elements per scale, by span"),
    "diagnostics/level_stats.py": (2, "a level's groups, by span"),
    "diagnostics/block_stats.py": (1, "NVFP4's statistics read its tensor scale"),
}
"""Modules that may branch on a format's kind outside :data:`WHERE_KINDS_DECIDE`: at most this
many conditions each, and why."""


def kind_reads(source: str) -> list[int]:
    """Line numbers of the conditions (``if``, ``while``, conditional expressions,
    comprehension filters, ``assert``) in ``source`` that read a kind attribute."""
    tests = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
    lines = set()
    for test in tests:
        for node in ast.walk(test):
            if isinstance(node, ast.Attribute) and node.attr in KIND_ATTRIBUTES:
                lines.add(node.lineno)
    return sorted(lines)


def package_kind_reads() -> dict[str, list[int]]:
    """Every module's kind reads outside :data:`WHERE_KINDS_DECIDE`."""
    reads = collections.defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        module = path.relative_to(SRC).as_posix()
        if module not in WHERE_KINDS_DECIDE:
            lines = kind_reads(path.read_text())
            if lines:
                reads[module] = lines
    return dict(reads)


def test_kinds_decide_behaviour_only_where_listed():
    problems = []
    for module, lines in package_kind_reads().items():
        allowed, _ = ALLOWED.get(module, (0, ""))
        if len(lines) > allowed:
            problems.append(
                f"{module}: {len(lines)} conditions read a format's kind (lines {lines}), "
                f"{allowed} allowed"
            )
    assert not problems, "\n".join(problems)


def test_the_allowances_are_all_used():
    reads = package_kind_reads()
    stale = {m: n for m, (n, _) in ALLOWED.items() if len(reads.get(m, ())) < n}
    assert not stale, f"lower these allowances to what the modules read now: {stale}"


def test_the_checker_finds_each_kind_of_condition():
    source = textwrap.dedent(
        """
        def f(fmt, xs):
            if fmt.span == "row":
                pass
            y = 1 if fmt.is_mx else 2
            while fmt.scale_kind.pow2:
                break
            zs = [x for x in xs if x.coding == "bytes"]
            assert fmt.gemm_operand
            return fmt.block  # not a kind
        """
    )
    assert kind_reads(source) == [3, 5, 6, 8, 9]
