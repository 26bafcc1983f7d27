"""interpret: the reference interpreter — runs any traced Graph with the primitives' torch references.

Inputs, weights and state are bound by name; state tensors are written in place by effectful
equations, exactly as the generated kernels will do. CPU or GPU, fp32 or bf16. For precision studies an
fp32 run can round only the activations that enter a `linear` to bf16 (`bf16_matmul_inputs`): the
rounding every backend whose GEMMs read bf16 activations must do, and nothing else.

A graph is prepared once into a `Program` (each equation's reference, argument slots and output slots
resolved, literals in place), which a backend keeps and runs per call: the per-call work is then the
references themselves, not the walk over the IR (a decode step of the small model is ~250 equations,
most of them microseconds of torch each).
"""
from __future__ import annotations

import time

from . import reference_fused, reference_ops, reference_replayssm, reference_vision
from ._torch import torch
from .ir import Graph, Lit
from .prims import PRIMS


def _rounded_to_bf16(reference):
    def linear(x, w):
        return reference(x.to(torch.bfloat16).to(x.dtype), w)
    return linear


class Program:
    """`graph` prepared for repeated runs. Values live in a flat list: slots for the graph's inputs,
    weights and state, the literals, then every equation output."""

    def __init__(self, graph: Graph, *, bf16_matmul_inputs: bool = False):
        reference_ops.bind_torch()
        reference_fused.bind_torch()
        reference_replayssm.bind_torch()
        reference_vision.bind_torch()
        self.graph = graph
        self.template: list = [None]                     # slot 0 holds None (an absent optional input)
        slots: dict[int, int] = {}

        def new_slot(value=None) -> int:
            self.template.append(value)
            return len(self.template) - 1

        self.bindings = []                               # (group, declared names → slots)
        for group, declared in (("input", graph.inputs), ("weight", graph.weights), ("state", graph.state)):
            names = []
            for name, var in declared.items():
                slots[var.uid] = new_slot()
                names.append((name, slots[var.uid]))
            self.bindings.append((group, names))

        def arg_slot(x) -> int:
            if x is None:
                return 0
            if isinstance(x, Lit):
                return new_slot(x.value)
            return slots[x.uid]

        self.steps = []                                  # (reference, argument slots, params, output slots)
        for eqn in graph.eqns:
            fn = PRIMS[eqn.prim].reference
            if bf16_matmul_inputs and eqn.prim == "linear":
                fn = _rounded_to_bf16(fn)
            args = tuple(arg_slot(x) for x in eqn.inputs)
            outs = []
            for var in eqn.outputs:
                slots[var.uid] = new_slot()
                outs.append(slots[var.uid])
            self.steps.append((fn, args, dict(eqn.params), tuple(outs), eqn.prim))
        self.outputs = [(name, slots[var.uid]) for name, var in graph.outputs.items()]

    def run(self, inputs: dict, weights: dict, state: dict, profile: tuple[dict, dict] | None = None) -> dict:
        """Evaluate the graph; returns its outputs by name. Missing bindings raise KeyError naming them.
        `profile` = (seconds, calls) dicts keyed by (graph entry, primitive): every equation timed (wall)."""
        env = self.template.copy()
        for (group, names), values in zip(self.bindings, (inputs, weights, state)):
            try:
                for name, slot in names:
                    env[slot] = values[name]
            except KeyError:
                missing = [name for name, _ in names if name not in values]
                raise KeyError(f"graph {self.graph.name}: no {group} bound for {', '.join(missing[:5])}") from None
        if profile is None:
            for fn, args, params, outs, _ in self.steps:
                out = fn(*[env[i] for i in args], **params)
                _store(env, outs, out)
        else:
            seconds, calls = profile
            entry = self.graph.name.rsplit(".", 1)[-1]
            for fn, args, params, outs, prim in self.steps:
                t0 = time.perf_counter()
                _store(env, outs, fn(*[env[i] for i in args], **params))
                seconds[entry, prim] += time.perf_counter() - t0
                calls[entry, prim] += 1
        return {name: env[slot] for name, slot in self.outputs}


def _store(env: list, outs: tuple, out) -> None:
    """Put a reference's result (one value, a tuple of them, or None for a pure effect) in its slots."""
    if len(outs) == 1 and not isinstance(out, tuple):
        env[outs[0]] = out
    elif outs or out is not None:
        for slot, value in zip(outs, out, strict=True):
            env[slot] = value


def run_graph(graph: Graph, inputs: dict, weights: dict, state: dict, *, bf16_matmul_inputs: bool = False) -> dict:
    """Evaluate `graph` once (prepares a Program; keep one with `Program(graph)` to run a graph repeatedly);
    returns its outputs by name. Missing bindings raise KeyError naming them."""
    return Program(graph, bf16_matmul_inputs=bf16_matmul_inputs).run(inputs, weights, state)
