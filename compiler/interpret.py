"""interpret: the reference interpreter — runs any traced Graph with the primitives' torch references.

Inputs, weights and state are bound by name; state tensors are written in place by effectful
equations, exactly as the generated kernels will do. CPU or GPU, fp32 or bf16.
"""
from __future__ import annotations

from .ir import Graph, Lit
from .prims import PRIMS


def run_graph(graph: Graph, inputs: dict, weights: dict, state: dict) -> dict:
    """Evaluate `graph`; returns its outputs by name. Missing bindings raise KeyError naming them."""
    env: dict[int, object] = {}
    bindings = (("input", graph.inputs, inputs), ("weight", graph.weights, weights), ("state", graph.state, state))
    for group, declared, values in bindings:
        missing = [k for k in declared if k not in values]
        if missing:
            raise KeyError(f"graph {graph.name}: no {group} bound for {', '.join(missing[:5])}")
        for k, v in declared.items():
            env[v.uid] = values[k]
    for eqn in graph.eqns:
        args = [None if x is None else x.value if isinstance(x, Lit) else env[x.uid] for x in eqn.inputs]
        for var, val in zip(eqn.outputs, PRIMS[eqn.prim].apply(*args, **eqn.params), strict=True):
            env[var.uid] = val
    return {k: env[v.uid] for k, v in graph.outputs.items()}


