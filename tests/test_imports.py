"""The import graph of compiler/ and ninfer_gen/, read statically (ast, nothing imported): no circle of
modules, no private name taken from another file, and the layers' arrows one way (DESIGN.md §6).

What counts as an import: every `import` / `from … import` statement, at module level or inside a
function, except under `if TYPE_CHECKING:` (annotations only, never run). `from a.b import c` is an edge
to the module a.b.c when there is one, else to a.b; a parent package's __init__ is not an edge (Python
runs it first, but a submodule import does not make the package and the submodule a circle).

Private names: `_x` (not `__x__`) is private to the module that defines it, and a module or package named
`_x` is private to the package that holds it (`compiler/_torch.py` is for `compiler.*`). No allow-list.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("compiler", "ninfer_gen")


def _module_names() -> dict[str, Path]:
    names = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts)] = path
    return names


MODULES = _module_names()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _known(dotted: str) -> str | None:
    """The longest prefix of `dotted` that is one of our modules (None: not ours)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return None


class _Imports(ast.NodeVisitor):
    """Per file: the imports (target module, line, imported names) outside `if TYPE_CHECKING:`, and which
    local names are bound to one of our modules."""

    def __init__(self, module: str):
        self.module = module
        self.found: list[tuple[str, int, str | None]] = []   # (our module, line, name taken from it or None)
        self.bound: dict[str, str] = {}                      # local name → our module it is bound to

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            target = _known(alias.name)
            if target is None:
                continue
            self.found.append((target, node.lineno, None))
            if alias.asname:
                self.bound[alias.asname] = target
            else:                                            # `import a.b` binds `a`
                self.bound[alias.name.split(".")[0]] = alias.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.module if _is_package(self.module) else self.module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        if _known(base) is None:
            return
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in MODULES:
                self.found.append((sub, node.lineno, None))
                self.bound[alias.asname or alias.name] = sub
            else:
                self.found.append((_known(base), node.lineno, alias.name))


def _scan(module: str, text: str | None = None) -> tuple[_Imports, ast.Module]:
    tree = ast.parse(MODULES[module].read_text() if text is None else text, str(MODULES[module]))
    imports = _Imports(module)
    imports.visit(tree)
    return imports, tree


SCANS = {m: _scan(m) for m in MODULES}


def _edges() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in SCANS[m][0].found if t != m} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _a_loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest circle through the component's first module, for the message."""
    start, inside = component[0], set(component)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for nxt in sorted(graph[path[-1]] & inside):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                paths.append(path + [nxt])
    return component


def _line(module: str, target: str) -> str:
    lines = sorted({line for t, line, _ in SCANS[module][0].found if t == target})
    return f"{MODULES[module].relative_to(ROOT)}:{','.join(map(str, lines))}"


def test_no_import_circles():
    graph = _edges()
    found = _cycles(graph)
    report = []
    for component in found:
        loop = _a_loop(graph, component)
        where = ", ".join(_line(a, b) for a, b in zip(loop, loop[1:]))
        report.append(f"{len(component)} modules {component}: {' → '.join(loop)} ({where}); its arrows:")
        report += [f"    {a} → {b} ({_line(a, b)})" for a in component for b in sorted(graph[a] & set(component))]
    assert not found, "import circles:\n" + "\n".join(report)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _owner_of_private_module(module: str) -> str | None:
    """The package a module is private to (its first `_x` component's parent), None if public."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if _private(part):
            return ".".join(parts[:i])
    return None


def _private_uses(module: str, scan: tuple[_Imports, ast.Module] | None = None) -> list[str]:
    imports, tree = scan or SCANS[module]
    where = MODULES[module].relative_to(ROOT)
    out = []
    for target, line, name in imports.found:
        owner = _owner_of_private_module(target)
        if owner is not None and not module.startswith(owner + "."):
            out.append(f"{where}:{line}: imports {target}, private to {owner}")
        if name is not None and _private(name):
            out.append(f"{where}:{line}: from {target} import {name}")
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, base = [node.attr], node.value
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or base.id not in imports.bound:
            continue
        dotted = imports.bound[base.id]
        for part in chain:
            if f"{dotted}.{part}" in MODULES:                # a submodule: private to its package if `_x`
                if _private(part) and not module.startswith(dotted + "."):
                    out.append(f"{where}:{node.lineno}: {base.id}.{'.'.join(chain)} (module private to {dotted})")
                dotted = f"{dotted}.{part}"
                continue
            if _private(part) and dotted != module:
                out.append(f"{where}:{node.lineno}: {base.id}{''.join('.' + c for c in chain)} "
                           f"(private name {part} of {dotted})")
            break
    return out


def test_no_private_name_is_imported_across_files():
    found = [use for m in MODULES for use in _private_uses(m)]
    assert not found, "private names used across files:\n" + "\n".join(sorted(set(found)))


def _crossings(importers: str, imported: str) -> list[str]:
    def inside(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")
    graph = _edges()
    return [f"{_line(m, t)}: {m} imports {t}" for m in MODULES if inside(m, importers)
            for t in sorted(graph[m]) if inside(t, imported)]


@pytest.mark.parametrize("importers,imported", [("compiler", "ninfer_gen"),
                                                ("ninfer_gen.engine", "ninfer_gen.executor"),
                                                ("ninfer_gen.executor", "ninfer_gen.engine")])
def test_layers_import_one_way(importers, imported):
    """The compiler never imports the runtime; engine/ and executor/ do not import each other (shared small
    types sit in a leaf module both may import; the wiring is a composition root above both)."""
    found = _crossings(importers, imported)
    assert not found, f"{importers} must not import {imported}:\n" + "\n".join(found)


def test_the_walk_sees_what_it_should():
    """The reader itself: relative, function-level and TYPE_CHECKING imports, and module attributes."""
    graph = _edges()
    assert "compiler.ir" in graph["compiler.passes"] and "compiler.prims" in graph["compiler.interpret"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _a_loop({"a": {"b", "d"}, "b": {"c"}, "c": {"a"}, "d": {"c"}}, ["a", "b", "c", "d"]) == ["a", "b", "c", "a"]
    assert _owner_of_private_module("compiler._torch") == "compiler" and _owner_of_private_module("compiler.ir") is None
    source = ("from typing import TYPE_CHECKING\nimport compiler.passes\nfrom compiler import reference_ops as ref\n"
              "from . import _torch\nif TYPE_CHECKING:\n    from compiler.trace import trace\n"
              "def f(x):\n    from compiler.prims import _prim\n    return ref._derived, compiler.passes._uses, x._y\n")
    imports, _ = scan = _scan("compiler.interpret", source)
    assert {t for t, _, _ in imports.found} == {"compiler.passes", "compiler.reference_ops", "compiler._torch",
                                                "compiler.prims"}                   # not trace: TYPE_CHECKING
    uses = _private_uses("compiler.interpret", scan)
    assert len(uses) == 3 and all(any(n in u for u in uses) for n in ("import _prim", "ref._derived", "passes._uses"))
    assert any("compiler._torch, private to compiler" in u for u in _private_uses("ninfer_gen.api", _scan(
        "ninfer_gen.api", "from compiler._torch import torch\n")))
