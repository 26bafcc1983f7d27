"""ir: the graph IR — typed variables, equations and graphs, and their stable text form.

A Graph is flat and single-assignment (layers unrolled). Its text is what golden tests compare and
what the build cache key hashes. Primitive semantics live in `compiler.prims`, never here; a leaf: it
imports no other compiler module (`compiler.typecheck` checks a Graph against the primitives).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("f32", "bf16", "f16", "i32", "i8")


@dataclass(frozen=True)
class AVal:
    """Abstract value: a static shape and a dtype name."""
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self):
        assert self.dtype in DTYPES, f"unknown dtype {self.dtype}"
        for d in self.shape:           # a loop, not all(genexpr): tracing makes ~10^5 of these
            assert type(d) is int and d >= 0, f"bad shape {self.shape}"

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


_ids = itertools.count()


class Var:
    """A graph value. Identity is the object; `name` is assigned when the graph is printed."""
    __slots__ = ("aval", "hint", "uid")

    def __init__(self, aval: AVal, hint: str = ""):
        self.aval = aval
        self.hint = hint
        self.uid = next(_ids)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.aval.shape

    @property
    def dtype(self) -> str:
        return self.aval.dtype

    def __repr__(self) -> str:
        return f"Var({self.hint or self.uid}: {self.aval})"


@dataclass(frozen=True)
class Lit:
    value: Any

    def __str__(self) -> str:
        return repr(self.value)


@dataclass
class Eqn:
    prim: str
    inputs: list[Var | Lit | None]
    params: dict[str, Any]
    outputs: list[Var]


@dataclass
class Graph:
    """inputs: per-call device buffers; weights and state: named, bound by the runtime; state is
    read and written in place by effectful equations (those with no outputs)."""
    name: str
    inputs: dict[str, Var]
    weights: dict[str, Var]
    state: dict[str, Var]
    eqns: list[Eqn]
    outputs: dict[str, Var]
    params: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return format_graph(self)


def _fmt_param(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_fmt_param(x) for x in v) + ")"
    return str(v)


def value_names(g: Graph) -> dict[int, str]:
    """uid → the name the graph's text gives it: `%key` for inputs, `@key` for weights and state, then
    `%0`, `%1`, … in order of first appearance (stable across traces of the same program)."""
    names: dict[int, str] = {}
    for title, group in (("in", g.inputs), ("weight", g.weights), ("state", g.state)):
        for key, v in group.items():
            names[v.uid] = f"%{key}" if title == "in" else f"@{key}"
    counter = itertools.count()
    for e in g.eqns:
        for v in (*e.inputs, *e.outputs):
            if isinstance(v, Var) and v.uid not in names:
                names[v.uid] = f"%{next(counter)}"
    return names


def format_graph(g: Graph) -> str:
    """Stable jaxpr-like text (names from `value_names`)."""
    names = value_names(g)

    def name(v: Var | Lit | None) -> str:
        if v is None:
            return "_"
        if isinstance(v, Lit):
            return str(v)
        return names[v.uid]

    lines = [f"graph {g.name} " + " ".join(f"{k}={_fmt_param(v)}" for k, v in sorted(g.params.items())) + " {"]
    for title, group in (("in", g.inputs), ("weight", g.weights), ("state", g.state)):
        for key, v in group.items():
            lines.append(f"  {title} {names[v.uid]}: {v.aval}")
    for e in g.eqns:
        params = " ".join(f"{k}={_fmt_param(v)}" for k, v in sorted(e.params.items()))
        args = ", ".join(name(x) for x in e.inputs)
        outs = ", ".join(f"{name(o)}: {o.aval}" for o in e.outputs)
        lhs = f"{outs} = " if outs else ""
        lines.append(f"  {lhs}{e.prim}[{params}]({args})" if params else f"  {lhs}{e.prim}({args})")
    lines.append("  return " + ", ".join(f"{k}={name(v)}" for k, v in g.outputs.items()))
    lines.append("}")
    return "\n".join(lines)
