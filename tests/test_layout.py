"""The package layout stays navigable: few top-level entries, imports along the data flow, no
cycles, short modules, no re-export shims, a docstring per subpackage, a light ``import treetrain``.

Imports are read with ``ast`` (nothing is imported except where a test says so), function-local
imports included; imports under ``if TYPE_CHECKING:`` are left out (they never run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "treetrain"

# a package may import only itself and the packages before it
ORDER = [
    "trees", "data", "attention", "models", "logprobs", "objectives",
    "parallel", "train", "integrations", "bench", "cli",
]
MAX_TOP_LEVEL = 12
MAX_LINES = 600
# import places besides the public API: a subpackage whose __init__ imports names from its own modules
# so users import them from one place. treetrain.integrations.trl: the four TRL drop-ins (issue 36)
IMPORT_PLACES = {"treetrain.integrations.trl"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


@cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (its ``else`` does run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(name: str) -> list[tuple[str, list[str], int]]:
    """``(module, names, line)`` for every runtime import in module ``name`` (names: the imported
    names of a ``from`` import, empty for ``import x``)."""
    path = modules()[name]
    out = []
    for node in runtime_nodes(parse(path)):
        if isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = _resolve_relative(name, path.name == "__init__.py", node.level, node.module)
            out.append((mod, [a.name for a in node.names], node.lineno))
    return out


def treetrain_edges(name: str) -> set[str]:
    """The treetrain modules that module ``name`` imports (a ``from pkg import sub`` of a submodule
    counts as an import of the submodule)."""
    mods = modules()
    edges = set()
    for mod, names, _ in imports_of(name):
        if mod != "treetrain" and not mod.startswith("treetrain."):
            continue
        subs = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in mods]
        edges.update(subs or [mod])
    edges.discard(name)
    return edges


def package_of(name: str) -> str | None:
    """The ORDER entry module ``name`` belongs to (None: the public API module and ``__main__``)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ORDER else None


def test_top_level_entries():
    entries = sorted(
        p.name for p in PKG.iterdir()
        if p.name not in {"__init__.py", "__main__.py", "__pycache__"} and not p.name.startswith(".")
    )
    assert len(entries) <= MAX_TOP_LEVEL, f"{len(entries)} top-level entries in src/treetrain: {entries}"


def test_module_lengths():
    long = {n: len(p.read_text().splitlines()) for n, p in modules().items()}
    long = {n: k for n, k in long.items() if k > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them): {long}"


def test_no_import_cycle():
    graph = {n: treetrain_edges(n) & set(modules()) for n in modules()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_import_direction():
    rank = {p: i for i, p in enumerate(ORDER)}
    bad = []
    for name in modules():
        src = package_of(name)
        if src is None:
            continue
        for target in treetrain_edges(name):
            dst = package_of(target)
            if dst is not None and rank[dst] > rank[src]:
                bad.append(f"{name} imports {target} ({src} may not import {dst})")
    assert not bad, "imports against the data flow " + " < ".join(ORDER) + ":\n" + "\n".join(bad)


def _provided_names(mod: str) -> set[str]:
    """What ``from mod import name`` may take: the names ``mod`` defines, and for an import place
    the names its ``__init__`` imports from its own submodules (``__all__`` lists them)."""
    mods = modules()
    names = _defined_names(parse(mods[mod]))
    if mod in IMPORT_PLACES:
        for sub, imported, _ in imports_of(mod):
            if sub.startswith(mod + "."):
                names.update(imported)
    return names


def _defined_names(tree: ast.Module) -> set[str]:
    """Names a module defines at top level (functions, classes, assignments; imports excluded),
    looking inside top-level ``if``/``try`` blocks."""
    names: set[str] = set()
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If):
            stack.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend(node.body + node.orelse + node.finalbody)
            for h in node.handlers:
                stack.extend(h.body)
        elif isinstance(node, ast.With):
            stack.extend(node.body)
    return names


def _python_files() -> list[Path]:
    files = []
    for d in ("src", "tests", "benchmarks", "examples", "scripts"):
        files.extend(sorted((ROOT / d).rglob("*.py")))
    return files


def test_no_reexport():
    mods = modules()
    bad = []
    for path in _python_files():
        for node in ast.walk(parse(path)):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            mod = node.module
            if mod == "treetrain" or not mod.startswith("treetrain."):
                continue  # the public API module is the one place that lists names from elsewhere
            if mod not in mods:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: no module {mod}")
                continue
            defined = _provided_names(mod)
            for a in node.names:
                if a.name != "*" and a.name not in defined and f"{mod}.{a.name}" not in mods:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {a.name} is not defined in {mod}")
    assert not bad, "import each name from the module that defines it:\n" + "\n".join(bad)


def _module_aliases(tree: ast.AST, mods: dict[str, Path]) -> dict[str, str]:
    """Local names bound to a treetrain module: ``from treetrain.data import reader as r``,
    ``import treetrain.data.reader as r``; a name the file also binds otherwise (an argument, an
    assignment) is left out, since which binding a use sees depends on its scope."""
    rebound = {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    rebound |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for a in node.names:
                if f"{node.module}.{a.name}" in mods:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in mods:
                    aliases[a.asname] = a.name
    return {k: v for k, v in aliases.items() if k not in rebound}


def test_import_places_only_gather_their_own_modules():
    """An import place's ``__init__`` defines nothing and imports only from its own submodules,
    exactly the names of its ``__all__``."""
    for place in IMPORT_PLACES:
        tree = parse(modules()[place])
        imports = imports_of(place)
        assert all(sub.startswith(place + ".") for sub, _, _ in imports), imports
        gathered = {n for _, names, _ in imports for n in names}
        assert _defined_names(tree) == {"__all__"}, _defined_names(tree)
        all_ = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__")
        assert {e.value for e in all_.elts} == gathered


def test_module_attributes_exist():
    """``alias.name`` on an imported treetrain module names something that module defines (a moved
    function otherwise fails only when that line runs)."""
    mods = modules()
    bad = []
    for path in _python_files():
        tree = parse(path)
        aliases = _module_aliases(tree, mods)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and isinstance(node.ctx, ast.Load)
            ):
                mod = aliases[node.value.id]
                if node.attr not in _provided_names(mod) and f"{mod}.{node.attr}" not in mods:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {mod} defines no {node.attr}")
    assert not bad, "\n".join(bad)


def test_subpackage_docstrings():
    bad = []
    for d in sorted(p for p in PKG.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        if not any(d.glob("*.py")):
            continue  # data only (samples/)
        init = d / "__init__.py"
        doc = ast.get_docstring(parse(init)) if init.exists() else None
        rel = d.relative_to(SRC)
        if not doc or len(doc.split()) < 8:
            bad.append(f"{rel}: no docstring saying what it holds")
        elif "may import" not in doc.lower():
            bad.append(f"{rel}: docstring does not say what it may import ('May import: ...')")
    assert not bad, "\n".join(bad)


def test_import_treetrain_is_light():
    code = (
        "import sys, treetrain\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "assert sorted(treetrain._API) == sorted(n for n in treetrain.__all__ if n != '__version__')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr


def test_public_api_resolves():
    import treetrain

    for name in treetrain.__all__:
        obj = getattr(treetrain, name)
        if name != "__version__":
            home = treetrain._API[name]
            assert name in _defined_names(parse(modules()[home])), f"{name} is not defined in {home}"
            assert getattr(obj, "__module__", home) == home, name

