"""chains: the last lowering step that puts decode GEMV launches together (`CompileOptions.chain`; issue 32's fewer
kernel boundaries per forward). A plan's calls are already cut into groups that may run at once
(`lower.concurrent_groups`: a layer's input projections); this step turns

- "group": every group of two or more GEMVs into one launch of one stage (no graph branches);
- "chain": that, and every run of consecutive GEMVs that depend on each other (a layer's output projection and its
  MLP: gate/up, then down) into one launch whose stages run in order inside it (compiler/kernels/gemv_chain.py).
  A chain does not take a group: mixing a concurrent group's narrow and wide blocks into one chain took the
  27B's 4-stage chain past 128 registers (spills), where its parts stayed within them (ptxas, sm_90 and sm_86).

Only our weight formats join (the GGUF k-quants' template has no member mode). A chain's members keep the
bindings their own calls had, workspace lanes included (stages run in order, so members of different stages may
share a lane's workspace; members of one stage came from one group, so their lanes differ). A chained launch's
counters lie in the zeroed workspace of lane 0, past everything the plan's calls use there.

Measured (lab/NOTES.md, session 15; 27B decode step, H100, same process): 580 → 404 → 276 launches, and the step
+2.4 % (group) and +22.6 % (chain) slower on sm_90, +1.3 % / +9.2 % on the sm_86 path: a joined launch gives every
member the widest member's registers and block, which costs the big GEMVs more than the boundaries cost. So "off".
"""
from __future__ import annotations

from .kernels import gemv_chain
from .kernels.gemv_chain import MAX_MEMBERS, member_param
from .options import CHAIN_MODES
from .plan import Call, Workspace

COUNTER_BYTES = 256                  # one aligned region holds a chain's stages + 2 counters (≤ 64)


def joinable(c: Call) -> bool:
    """A call a chain may take: a decode GEMV of our weight formats."""
    return c.launch is not None and c.key.family == "gemv" and c.key.template is None


def chain_calls(calls: list[Call], groups: list[list[int]], mode: str,
                workspace: dict[str, tuple[int, ...]]) -> tuple[list[Call], list[list[int]], dict]:
    """(calls, groups, workspace) with the joined launches in place of their members."""
    if mode not in CHAIN_MODES:
        raise ValueError(f"chain mode {mode!r}: expected one of {', '.join(CHAIN_MODES)}")
    if mode == "off":
        return calls, groups, workspace
    zeroed = list(workspace.get("zeroed", (0,))) or [0]
    counters = Workspace("zeroed", zeroed[0], 0)
    runs: list[list[list[int]]] = []            # each: the groups one launch takes (or one group left alone)
    for g in groups:
        prev = runs[-1] if runs else None
        if (mode == "chain" and len(g) == 1 and joinable(calls[g[0]]) and prev is not None
                and all(len(h) == 1 and joinable(calls[h[0]]) for h in prev) and len(prev) < MAX_MEMBERS):
            prev.append(g)
        else:
            runs.append([g])
    out_calls: list[Call] = []
    out_groups: list[list[int]] = []
    chained = False
    for run in runs:
        members = [i for g in run for i in g]
        if len(members) >= 2 and all(joinable(calls[i]) for i in members):
            call = _joined(calls, run, counters)
            chained |= len(run) > 1
            out_groups.append([len(out_calls)])
            out_calls.append(call)
        else:
            for g in run:
                out_groups.append([len(out_calls) + n for n in range(len(g))])
                out_calls += [calls[i] for i in g]
    if chained:
        zeroed[0] += COUNTER_BYTES
        workspace = {**workspace, "zeroed": tuple(zeroed)}
    return out_calls, out_groups, workspace


def _joined(calls: list[Call], run: list[list[int]], counters: Workspace) -> Call:
    stages = tuple(tuple(calls[i].key for i in g) for g in run)
    key = gemv_chain.Key(stages, calls[run[0][0]].key.arch)
    members = [calls[i] for g in run for i in g]
    args = [("counters", counters)] if key.chained else []
    for n, c in enumerate(members):
        args += [(member_param(n, name), binding) for name, binding in c.args]
    first = members[0]
    return Call(key, gemv_chain.launch(key), first.eqn, tuple(args),
                tuple(dict.fromkeys(x for c in members for x in c.inputs)),
                tuple(dict.fromkeys(x for c in members for x in c.outputs)), first.programmatic, 0)
