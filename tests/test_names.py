"""Every global name a function of the project reads is defined: imported or assigned at module level, or a
builtin (read statically with `symtable`, nothing imported). Code paths that only a GPU runs are never executed
by CI; an undefined name there (ninfer_gen/lanes/gpu.py once read ACCEPTANCE_OF without importing it, and every
GPU round failed) is caught here instead of on the device."""
from __future__ import annotations

import builtins
import symtable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("compiler", "ninfer_gen", "lab", "tools", "tests")
IMPLICIT = set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__", "__path__", "__package__",
                                 "__builtins__", "__annotations__", "__loader__"}


def undefined_names(path: Path) -> list[str]:
    """`scope: name` for each global a function or class of `path` reads that the module never binds."""
    source = path.read_text()
    if "import *" in source:
        return []
    top = symtable.symtable(source, str(path), "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    out = []

    def walk(table):
        for s in table.get_symbols():
            if (table.get_type() != "module" and s.is_global() and not s.is_declared_global() and s.is_referenced()
                    and s.get_name() not in bound and s.get_name() not in IMPLICIT):
                out.append(f"{table.get_name()}: {s.get_name()}")
        for child in table.get_children():
            walk(child)

    walk(top)
    out += [f"<module>: {s.get_name()}" for s in top.get_symbols()
            if s.is_referenced() and s.get_name() not in bound and s.get_name() not in IMPLICIT]
    return out


def test_no_function_reads_an_undefined_global():
    missing = {str(p.relative_to(ROOT)): names for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))
               if (names := undefined_names(p))}
    assert not missing, f"undefined names: {missing}"


def test_the_check_finds_one(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\ndef f():\n    return TABLE[1] + os.sep\n\nclass A:\n    def g(self):\n        return x\n")
    assert undefined_names(bad) == ["f: TABLE", "g: x"]
