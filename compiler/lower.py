"""lower: fused Graph → Plan. Runs each equation's lowering rule (`lower_rules.RULES`), lays out the
arena with the dtypes the kernels write, resolves every binding to where its value lives and checks it
against the family's parameters, cuts the calls into graph branches (runs of independent GEMVs, one
workspace lane each), marks which calls launch programmatically and, if asked, joins GEMV launches
(compiler/chains.py). The runtime only resolves the
bindings to pointers.
"""
from __future__ import annotations

from .arena import VIEWS, ArenaLayout, allocate
from .chains import chain_calls
from .ir import Graph, Var, value_names
from .kernels import module_of
from .lower_ctx import ZEROED_WORKSPACE, Ctx, LoweringError, Val, align
from .lower_rules import RULES
from .options import CompileOptions
from .plan import Arena, Call, Collective, Input, Output, Plan, PlanError, Weight, Workspace, check_args
from .spec import DRAFT_HEAD, ModelSpec, draft_head_info, format_of, tensor_table, vision_tensor_table
from .targets import Target, supports_pdl

__all__ = ["LoweringError", "PlanError", "lower", "concurrent_groups"]


class _Resolver:
    """Val → the binding of where the value lives: arena bytes (through views), a step input, a small
    weight's tensor, or the binding a launch-free equation aliases its output to."""

    def __init__(self, g: Graph, layout: ArenaLayout, names: dict[int, str], aliases: dict):
        self.layout, self.names, self.aliases = layout, names, aliases
        self.inputs = {v.uid: k for k, v in g.inputs.items()}
        self.weights = {v.uid: k for k, v in g.weights.items()}
        self.state = {v.uid: k for k, v in g.state.items()}

    def __call__(self, arg):
        if not isinstance(arg, Val):
            return arg
        v = arg.var
        b, off = self.layout.base(v)
        if b in self.layout.slots:
            return Arena(self.layout.slots[b][0] + off, self.names[v.uid])
        if off:
            raise LoweringError(f"{self.names[v.uid]}: an offset view of {self.names[b]}, which is not in the arena")
        if b in self.aliases:
            return self.aliases[b]
        if b in self.inputs:
            return Input(self.inputs[b])
        if b in self.weights:
            return Weight(self.weights[b], "tensor")
        raise LoweringError(f"{self.names[v.uid]} (state {self.state.get(b, '?')}) is bound as a plain value; "
                            "rules bind state buffers by name")


def concurrent_groups(calls: list[Call], arena: dict[str, tuple[int, int]], width: int = 4) -> list[list[int]]:
    """The calls in order, cut into groups that may run at once: runs of consecutive GEMVs (a layer's
    input projections all read the same normed activations) where no call reads or writes bytes
    another writes, and at most `width` per group. Every other call is a group of one."""
    def spans(names):
        return [arena[n] for n in names if n in arena]

    def overlap(xs, ys):
        return any(a < b + m and b < a + n for a, n in xs for b, m in ys)

    def independent(c: Call, d: Call) -> bool:
        if set(c.inputs) & set(d.outputs) or set(d.inputs) & set(c.outputs) or set(c.outputs) & set(d.outputs):
            return False
        return not (overlap(spans(c.outputs), spans(d.inputs) + spans(d.outputs))
                    or overlap(spans(d.outputs), spans(c.inputs)))

    groups: list[list[int]] = []
    for i, c in enumerate(calls):
        cur = groups[-1] if groups else None
        if (cur and c.key.family == "gemv" and len(cur) < width and all(calls[j].key.family == "gemv" for j in cur)
                and all(independent(c, calls[j]) for j in cur)):
            cur.append(i)
        else:
            groups.append([i])
    return groups


def _workspace_per_lane(calls: list[Call]) -> dict[str, tuple[int, ...]]:
    """Bytes each workspace lane needs per pool: the most any call in that lane uses (each region 256-byte
    aligned). Only grouped GEMVs use the lanes past 0, so those stay small."""
    lanes = 1 + max((c.lane for c in calls), default=0)
    need = {"scratch": [0] * lanes, "zeroed": [0] * lanes}
    for c in calls:
        if c.launch is None:                   # a collective uses no workspace
            continue
        fn = getattr(module_of(c.key), "workspace", None)
        sizes = fn(c.key) if fn else {}
        for pool, per_lane in need.items():
            total = sum(align(n) for name, n in sizes.items() if (name in ZEROED_WORKSPACE) == (pool == "zeroed"))
            per_lane[c.lane] = max(per_lane[c.lane], total)
    return {pool: tuple(per_lane) for pool, per_lane in need.items()}


def lower(g: Graph, spec: ModelSpec, target: Target, options: CompileOptions = CompileOptions()) -> Plan:
    """Lower a fused graph (after `passes.run_pipeline`) for one target card."""
    vision = g.params.get("entry") == "vision"            # the encoder's graph (trace_vision): the tower's tensors
    table = {t.name: t for t in (vision_tensor_table(spec) if vision else tensor_table(spec))}
    if DRAFT_HEAD in g.weights:
        table[DRAFT_HEAD] = draft_head_info(spec, g.weights[DRAFT_HEAD].shape[0])
    ctx = Ctx(spec, target, g, options, {v.uid: format_of(spec, table[k]) for k, v in g.weights.items()},
              {v.uid: k for k, v in g.weights.items()}, {v.uid: k for k, v in g.state.items()})
    lowered = {}
    for i, e in enumerate(g.eqns):
        if e.prim in VIEWS:                    # a view reads its source's bytes in the source's dtype
            if e.inputs[0].uid in ctx.wide:
                ctx.wide[e.outputs[0].uid] = ctx.wide[e.inputs[0].uid]
            continue
        if e.prim not in RULES:
            raise LoweringError(f"no lowering rule for primitive {e.prim!r} (eqn {i}); run the pass pipeline first")
        lowered[i] = RULES[e.prim](ctx, e)
        if lowered[i].out_dtype:
            ctx.wide[e.outputs[0].uid] = lowered[i].out_dtype
        if lowered[i].calls:
            ctx.scratch = lowered[i].scratch
    aliases = {g.eqns[i].outputs[0].uid: low.alias for i, low in lowered.items() if low.alias is not None}
    in_place = {g.eqns[i].outputs[0].uid: _overwritten(g, i, low.in_place)
                for i, low in lowered.items() if low.in_place is not None}
    layout = allocate(g, {g.eqns[i].outputs[0].uid: low.out_dtype for i, low in lowered.items() if low.out_dtype},
                      skip=set(aliases), in_place=in_place)
    names = value_names(g)
    resolve = _Resolver(g, layout, names, aliases)
    arena_name = lambda v: names[layout.base(v)[0]]                               # noqa: E731
    calls = []
    for i, low in lowered.items():
        e = g.eqns[i]
        reads = tuple(arena_name(x) for x in e.inputs if isinstance(x, Var) and layout.base(x)[0] in layout.slots)
        writes = tuple(arena_name(o) for o in e.outputs if layout.base(o)[0] in layout.slots)
        for key, args in low.calls:
            try:
                bound = check_args(key, {p: resolve(a) for p, a in args.items()})
            except PlanError as err:
                raise PlanError(f"{e.prim} (eqn {i}): {err}") from None
            launch = None if isinstance(key, Collective) else module_of(key).launch(key, target)
            calls.append(Call(key, launch, i, bound, reads, writes))
    arena = {names[u]: slot for u, slot in layout.slots.items()}
    groups = concurrent_groups(calls, arena, options.concurrency)
    lane = {i: n for group in groups for n, i in enumerate(group)}
    pdl = options.pdl and supports_pdl(target.arch)
    # a kernel after a collective waits for it in full: programmatic launch overlaps our kernels only
    calls = [_placed(c, lane[i], pdl and i > 0 and c.launch is not None and calls[i - 1].launch is not None)
             for i, c in enumerate(calls)]
    calls, groups, workspace = chain_calls(calls, groups, options.chain, _workspace_per_lane(calls))
    outputs = {k: Output(layout.offset(v), v.shape, layout.dtype(v)) for k, v in g.outputs.items()}
    p = g.params
    shape = ("vision", p["images"], p["patches"]) if vision else (p["entry"], p["batch"], p["tokens"])
    return Plan(g.name, target.name, calls, arena, layout.nbytes,
                live={names[u]: span for u, span in layout.live.items()},
                dtypes={names[u]: d for u, d in layout.dtypes.items()}, outputs=outputs, groups=groups,
                workspace=workspace, shape=shape,
                max_pages=g.inputs["block_table"].shape[1] if "block_table" in g.inputs else 0, options=options, graph=g)


def _overwritten(g: Graph, i: int, which: int) -> int:
    """The input `which` of equation i, whose bytes its kernel overwrites: nothing after it may read them,
    through the value or a view of it."""
    x = g.eqns[i].inputs[which]
    same = {x.uid}
    for e in g.eqns:
        if e.prim in VIEWS and e.inputs[0].uid in same:
            same.add(e.outputs[0].uid)
    later = any(isinstance(v, Var) and v.uid in same for e in g.eqns[i + 1:] for v in e.inputs)
    if later or any(v.uid in same for v in g.outputs.values()):
        raise LoweringError(f"{g.eqns[i].prim} (eqn {i}) overwrites an input that is read after it")
    return x.uid


def _placed(c: Call, lane: int, programmatic: bool) -> Call:
    """The call in its workspace lane; `programmatic`: it may start before its predecessor ends (the first
    call of a run never is, so a run starts after all earlier work, common/ptx.cuh)."""
    args = tuple((n, Workspace(b.pool, b.offset, lane) if isinstance(b, Workspace) else b) for n, b in c.args)
    return Call(c.key, c.launch, c.eqn, args, c.inputs, c.outputs, programmatic, lane)

