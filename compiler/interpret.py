"""interpret: the reference interpreter — runs any traced Graph with the primitives' torch references.

Inputs, weights and state are bound by name; state tensors are written in place by effectful
equations, exactly as the generated kernels will do. CPU or GPU, fp32 or bf16. For precision studies an
fp32 run can round only the activations that enter a `linear` to bf16 (`bf16_matmul_inputs`): the
rounding every backend whose GEMMs read bf16 activations must do, and nothing else.
"""
from __future__ import annotations

from ._torch import torch
from .ir import Graph, Lit
from .prims import PRIMS


def run_graph(graph: Graph, inputs: dict, weights: dict, state: dict, *, bf16_matmul_inputs: bool = False) -> dict:
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
        if bf16_matmul_inputs and eqn.prim == "linear":
            args[0] = args[0].to(torch.bfloat16).to(args[0].dtype)
        for var, val in zip(eqn.outputs, PRIMS[eqn.prim].apply(*args, **eqn.params), strict=True):
            env[var.uid] = val
    return {k: env[v.uid] for k, v in graph.outputs.items()}


