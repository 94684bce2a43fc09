"""The package's layers, checked from its import statements (docs/architecture.md).

``jaxmx/_src`` is cut into layers, lowest first: ``core``, ``quantize``, ``gemm``, ``training``,
``optim``, ``serving``, ``checkpoints``, ``diagnostics``, ``flax``. A module may import its own
layer and the ones below; the public facades (``jaxmx``, ``jaxmx.recipes``, ``jaxmx.checkpoints``,
``jaxmx.ffi``, ``jaxmx.diagnostics``, ``jaxmx.optim``, ``jaxmx.flax``) only re-export ``_src``
names, and the demo sits above everything. These tests read every module's imports with
``ast`` (nothing is imported) and fail on:

- a cycle among module-level imports of jaxmx modules;
- a ``_src`` module importing a public facade;
- a lower layer importing a higher one;
- a function-level import of a jaxmx module (the compiled extension ``jaxmx._ffi`` aside: a
  build may lack it, and :func:`jaxmx._src.gemm.extension.load` says why);
- a ``jax._src`` import outside :data:`JAX_PRIVATE_ALLOWED`;
- a private name (one leading underscore) of another jaxmx module, imported
  (``from module import _name``) or read (``module._name``): what modules share is public.

The checker itself is tested on a planted package with each problem.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import textwrap

LAYERS = (
    "core",
    "quantize",
    "gemm",
    "training",
    "optim",
    "serving",
    "checkpoints",
    "diagnostics",
    "flax",
)
FACADES = (
    "jaxmx",
    "jaxmx.recipes",
    "jaxmx.checkpoints",
    "jaxmx.ffi",
    "jaxmx.diagnostics",
    "jaxmx.optim",
    "jaxmx.flax",
    "jaxmx.flax.linen",
    "jaxmx.flax.nnx",
)
LAZY_ALLOWED = ("jaxmx._ffi",)
# the compiled extension: a module whose name the build gives it, not a private name of a module
PRIVATE_NAMES_ALLOWED = ("jaxmx._ffi",)
JAX_PRIVATE_ALLOWED = {
    # the decode of the shardings XLA hands a custom_partitioning rule: no public API
    "jaxmx._src.core.block_sharding": ("jax._src.sharding_impls",),
}


def modules(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """Every module of the package under ``root`` (a directory named like ``package``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(path: pathlib.Path, name: str, known: set[str]):
    """``(imported module, line, at module level)`` for each import in the file; a name taken
    from a package counts as its submodule where there is one."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nested = {
        id(node)
        for outer in ast.walk(tree)
        if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for node in ast.walk(outer)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolved(node, package)
            targets = [
                f"{base}.{alias.name}"
                if f"{base}.{alias.name}" in known or base.startswith("jax._src")
                else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            yield target, node.lineno, id(node) not in nested


def _resolved(node: ast.ImportFrom, package: str) -> str:
    """The absolute module name of a ``from ... import`` (relative imports resolved)."""
    base = node.module or ""
    if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
        base = f"{base}.{node.module}" if node.module else base
    return base


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of a chain of attribute reads on a name, else ``None``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def private_uses(path: pathlib.Path, name: str, root_package: str, known: set[str]):
    """``(line, what)`` for each private name of another module of ``root_package`` that the
    file imports (``from m import _x``) or reads as an attribute of an imported module
    (``m._x``, ``pkg.m._x``); :data:`PRIVATE_NAMES_ALLOWED` aside."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    allowed = {m.replace("jaxmx", root_package, 1) for m in PRIVATE_NAMES_ALLOWED}
    bound: dict[str, str] = {}  # local name -> the module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            base = _resolved(node, package)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:
                    bound[alias.asname or alias.name] = full
                if _is_private(alias.name) and _in(base, root_package) and full not in allowed:
                    yield node.lineno, f"imports the private name {alias.name} from {base}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
            continue
        dotted = _dotted(node.value)
        if dotted is None:
            continue
        head, _, rest = dotted.partition(".")
        module = bound.get(head, "") + (f".{rest}" if rest else "")
        submodule = f"{module}.{node.attr}" in known  # a dotted path: pkg._src.core
        if module in known and _in(module, root_package) and module != name and not submodule:
            yield node.lineno, f"reads the private name {node.attr} of {module}"


def layer_of(module: str, package: str) -> int | None:
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "_src" and parts[2] in LAYERS:
        return LAYERS.index(parts[2])
    return None


def problems(root: pathlib.Path, package: str = "jaxmx") -> list[str]:
    """Every breach of the rules in the module docstring, as readable lines."""
    found = modules(root, package)
    lazy_allowed = {m.replace("jaxmx", package, 1) for m in LAZY_ALLOWED}
    known = set(found) | lazy_allowed
    graph: dict[str, set[str]] = {m: set() for m in found}
    out = []
    facades = {f.replace("jaxmx", package, 1) for f in FACADES}
    private_allowed = {k.replace("jaxmx", package, 1): v for k, v in JAX_PRIVATE_ALLOWED.items()}
    for module, path in found.items():
        where = f"{path.relative_to(root.parent)}"
        out += [
            f"{where}:{line}: {what}" for line, what in private_uses(path, module, package, known)
        ]
        for target, line, top in imports(path, module, known):
            if target.startswith("jax._src"):
                if target not in private_allowed.get(module, ()):
                    out.append(f"{where}:{line}: imports private {target}")
                continue
            if target != package and not target.startswith(package + "."):
                continue
            if not top and target not in lazy_allowed:
                out.append(f"{where}:{line}: function-level import of {target}")
            if top and target in found:
                graph[module].add(target)
            in_src = module.startswith(f"{package}._src")
            if in_src and target in facades:
                out.append(f"{where}:{line}: _src module imports the public facade {target}")
            low, high = layer_of(module, package), layer_of(target, package)
            if low is not None and high is not None and high > low:
                out.append(
                    f"{where}:{line}: layer {LAYERS[low]!r} imports the higher layer "
                    f"{LAYERS[high]!r} ({target})"
                )
    out += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return list(dict.fromkeys(out))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of modules that import each other (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    result = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                result.append([*sorted(group), sorted(group)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


# found without importing it: a cycle may make the package fail to import
ROOT = pathlib.Path(importlib.util.find_spec("jaxmx").origin).parent


def test_the_package_keeps_its_layers():
    assert {"jaxmx._src.core.formats", "jaxmx._src.flax.ops"} <= set(modules(ROOT, "jaxmx"))
    assert problems(ROOT) == []


def test_every_layer_exists_with_a_docstring_only_init():
    src = ROOT / "_src"
    for layer in LAYERS:
        tree = ast.parse((src / layer / "__init__.py").read_text())
        assert len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr), layer


def plant(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for directory in [tmp_path / "pkg", *(tmp_path / "pkg").rglob("*")]:
        if directory.is_dir() and not (directory / "__init__.py").exists():
            (directory / "__init__.py").write_text('"""A layer."""\n')
    return tmp_path / "pkg"


def test_the_checker_finds_a_planted_cycle(tmp_path):
    root = plant(
        tmp_path,
        {
            "_src/core/a.py": "from pkg._src.core import b\n",
            "_src/core/b.py": "from pkg._src.core.c import x\n",
            "_src/core/c.py": "import pkg._src.core.a\nx = 1\n",
        },
    )
    assert problems(root, "pkg") == [
        "import cycle: pkg._src.core.a -> pkg._src.core.b -> pkg._src.core.c -> pkg._src.core.a"
    ]


def test_the_checker_finds_private_names_used_across_modules(tmp_path):
    root = plant(
        tmp_path,
        {
            "_src/core/a.py": "_x = 1\ny = _x\n",
            "_src/core/b.py": (
                "import pkg._src.core.a\n"
                "import pkg._src.core.a as aa\n"
                "from pkg._src.core import a\n"
                "from pkg._src.core.a import _x, y\n"
                "z = a._x + aa._x + pkg._src.core.a._x + a.y + y.__class__ + _x\n"
            ),
            "_src/gemm/e.py": "from pkg import _ffi\n",  # the extension, allowed by name
        },
    )
    assert problems(root, "pkg") == [
        "pkg/_src/core/b.py:4: imports the private name _x from pkg._src.core.a",
        "pkg/_src/core/b.py:5: reads the private name _x of pkg._src.core.a",
    ]


def test_the_checker_finds_upward_facade_lazy_and_private_imports(tmp_path):
    root = plant(
        tmp_path,
        {
            "__init__.py": "from pkg._src.core.a import x\n",
            "_src/core/a.py": "from pkg._src.gemm import g\nx = 1\n",
            "_src/gemm/g.py": "import pkg\n\ndef f():\n    from pkg._src.core import a\n",
            "_src/training/t.py": "from jax._src import core\nfrom ..core import a\n",
        },
    )
    found = problems(root, "pkg")
    assert (
        "pkg/_src/core/a.py:1: layer 'core' imports the higher layer 'gemm' (pkg._src.gemm.g)"
        in found
    )
    assert "pkg/_src/gemm/g.py:1: _src module imports the public facade pkg" in found
    assert "pkg/_src/gemm/g.py:4: function-level import of pkg._src.core.a" in found
    assert "pkg/_src/training/t.py:1: imports private jax._src.core" in found
    assert any(p.startswith("import cycle: pkg -> pkg._src.core.a") for p in found)
    assert len(found) == 5, found  # the relative import of a lower layer is fine
