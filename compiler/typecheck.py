"""typecheck: a Graph checked against the primitive table — definitions before use, single assignment,
and every equation's output avals equal to its primitive's shape rule. Run after tracing and after each
pass; `ir` stays a leaf that knows no primitive.
"""
from __future__ import annotations

from .ir import Graph, Var
from .prims import PRIMS


class TypeError_(TypeError):
    pass


def typecheck(g: Graph) -> None:
    """Every input is defined before use, every output is defined once, and every equation's
    output avals equal what its primitive's shape rule says."""
    defined = {v.uid for grp in (g.inputs, g.weights, g.state) for v in grp.values()}
    for i, e in enumerate(g.eqns):
        if e.prim not in PRIMS:
            raise TypeError_(f"eqn {i}: unknown primitive {e.prim!r}")
        for x in e.inputs:
            if isinstance(x, Var) and x.uid not in defined:
                raise TypeError_(f"eqn {i} ({e.prim}): input {x} used before it is defined")
        avals = [x.aval if isinstance(x, Var) else x for x in e.inputs]
        expected = PRIMS[e.prim].shape_rule(*avals, **e.params)
        got = [o.aval for o in e.outputs]
        if list(expected) != got:
            raise TypeError_(f"eqn {i} ({e.prim}): outputs {got} but the shape rule gives {list(expected)}")
        for o in e.outputs:
            if o.uid in defined:
                raise TypeError_(f"eqn {i} ({e.prim}): {o} assigned twice")
            defined.add(o.uid)
    for k, v in g.outputs.items():
        if v.uid not in defined:
            raise TypeError_(f"output {k} is never defined")
