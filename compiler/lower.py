"""lower: fused Graph → Plan — the ordered kernel calls (family key + launch dims), and every value's
binding: graph inputs, weights, state, or an offset in one activation arena reused by liveness.

One lowering rule per primitive (`RULES`): it returns the kernel keys the equation launches, or
nothing when the equation is a view (reshape, slice) or is absorbed by a neighbour's kernel (q/k
norm + RoPE and positions by the layer's `qk_rope_kv`; the MTP concat by the norms writing its halves). Argument packing per family is the
executable's job (`kernels.<family>.params`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

from .ir import Eqn, Graph, Var
from .kernels import (MATMUL_FAMILIES, Launch, attn_combine, attn_decode, attn_prefill, catalog, embed, gated_rmsnorm,
                      gdn_conv, gdn_step, module_of, qk_rope_kv, rmsnorm)
from .spec import ModelSpec, format_of, tensor_table
from .targets import Target

VIEWS = ("reshape", "slice")
# absorbed primitive → the kernel that does its work (concat: its producers write the two halves)
ABSORBED = {"norm_rope": "qk_rope_kv", "positions": "qk_rope_kv", "concat": "producers"}
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i8": 1}
ALIGN = 256


@dataclass(frozen=True)
class Call:
    key: object
    launch: Launch
    eqn: int                      # index of the graph equation it implements
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass
class Plan:
    name: str
    target: str
    calls: list[Call]
    arena: dict[str, tuple[int, int]]          # value → (offset, bytes)
    arena_bytes: int
    live: dict[str, tuple[int, int]] = field(default_factory=dict)   # value → (first, last) equation
    absorbed: Counter = field(default_factory=Counter)
    dtypes: dict[str, str] = field(default_factory=dict)       # arena value → dtype the kernel writes (if wider)
    graph: Graph | None = None                                 # the fused graph the calls implement

    @property
    def launches(self) -> int:
        return len(self.calls)

    def keys(self) -> list:
        return list(dict.fromkeys(c.key for c in self.calls))

    def family_counts(self) -> Counter:
        return Counter(c.key.family for c in self.calls)


@dataclass
class _Ctx:
    spec: ModelSpec
    target: Target
    graph: Graph
    weight_format: dict[int, str]
    weight_name: dict[int, str]

    @property
    def b(self) -> int:
        return self.graph.params["batch"]

    @property
    def t(self) -> int:
        return self.graph.params["tokens"]

    @property
    def m(self) -> int:
        return self.b * self.t

    @property
    def prefill(self) -> bool:
        return self.graph.params["entry"] == "prefill" or self.m > 32

    @property
    def max_pages(self) -> int:
        return self.graph.inputs["block_table"].shape[1]

    @property
    def kv_dtype(self) -> str:
        return "int8" if self.graph.params["kv"] == "int8" else "bf16"


def _matmul(ctx: _Ctx, x: Var, w: Var, n: int, epilogue: str = "none", out: str = "bf16"):
    """Skinny GEMV for up to 32 rows (decode, verify, cohorts, the prefill's last-token head),
    the tensor-core GEMM above."""
    return catalog.matmul_calls(ctx.weight_format[w.uid], n, w.shape[1], x.shape[0], ctx.target, epilogue, out)


def _linear(ctx, e):
    x, w = e.inputs
    is_head = ctx.weight_name[w.uid] in ("lm_head.weight", "embed_tokens.weight")
    return _matmul(ctx, x, w, w.shape[0], out="f32" if is_head or w.shape[0] < 64 else "bf16")


def _linear_residual(ctx, e):
    return _matmul(ctx, e.inputs[0], e.inputs[1], e.inputs[1].shape[0], "residual")


def _linear_silu_mul(ctx, e):
    return _matmul(ctx, e.inputs[0], e.inputs[1], 2 * e.inputs[1].shape[0], "silu_mul")


def _gemv_fields(ctx, e, keys, **fields):
    """Work a pass moved into a projection (the split RMSNorm, the GDN conv) lives in the decode GEMV's
    prologue and epilogue: its keys with `fields` set."""
    if any(k.family != "gemv" for k in keys):
        raise LoweringError(f"{e.prim}: needs the decode GEMV (M = {ctx.m} rows), not a prefill GEMM")
    return [replace(k, **fields) for k in keys]


def _linear_residual_norm(ctx, e):
    """(x, W, residual, norm weight) → h, xn, ssq: the residual GEMV with `norm_out`."""
    if e.params["offset"] != 1.0:
        raise LoweringError(f"{e.prim}: the GEMV normalises with (1 + w) only, not offset {e.params['offset']}")
    plain = _linear_residual(ctx, Eqn("linear_residual", e.inputs[:3], {}, e.outputs[:1]))
    return _gemv_fields(ctx, e, plain, norm_out=True)


def _scaled(rule):
    """(xn, ssq, W…) → the plain projection's GEMV with `scale_in`."""
    def lowered(ctx, e):
        plain = rule(ctx, Eqn(e.prim, [e.inputs[0], *e.inputs[2:]], {}, e.outputs))
        return _gemv_fields(ctx, e, plain, scale_in=True, eps=e.params["eps"])
    return lowered


def _with_conv(rule):
    """(x…, W, conv taps, history, slots) → the projection's GEMV with `conv` (the taps' width)."""
    def lowered(ctx, e):
        *head, taps, _, _ = e.inputs
        plain = rule(ctx, Eqn(e.prim, head, dict(e.params), e.outputs))
        return _gemv_fields(ctx, e, plain, conv=taps.shape[-1])
    return lowered


def _norm(add: bool):
    def rule(ctx, e):
        return [rmsnorm.Key(e.inputs[0].shape[-1], ctx.m, add, "bf16", e.params["eps"], ctx.target.arch)]
    return rule


def _embed(ctx, e):
    return [embed.Key(ctx.weight_format[e.inputs[1].uid], e.inputs[1].shape[1], ctx.m, ctx.target.arch)]


def _gdn_conv(ctx, e):
    c, w = e.inputs[0], e.inputs[1]
    return [gdn_conv.Key(c.shape[2], ctx.b, ctx.t, w.shape[2], "update", ctx.target.arch)]


def _gdn_step(ctx, e):
    """Prefill chunks of ≥ 64 tokens (one sequence) take the chunked WY kernel, the rest the sequential step."""
    q, _, v = e.inputs[:3]
    if ctx.graph.params["entry"] == "prefill" and ctx.b == 1 and ctx.t >= 64:
        return [catalog.prefill_gdn_key(q.shape[2], v.shape[2], q.shape[3], v.shape[3], ctx.t, ctx.target)]
    return [gdn_step.make_key(q.shape[2], v.shape[2], q.shape[3], v.shape[3], ctx.b, ctx.t, "step", ctx.target)]


def _gated_rmsnorm(ctx, e):
    _, hv, dv = e.inputs[0].shape
    return [gated_rmsnorm.Key(hv, dv, ctx.m, e.params["eps"], ctx.target.arch)]


def _kv_append(ctx, e):
    at, a = ctx.spec.model.attention, ctx.spec.model
    return [qk_rope_kv.Key(at.num_heads, at.num_kv_heads, at.head_dim, at.rotary_dim, ctx.b, ctx.t, ctx.kv_dtype,
                           e.params["page_size"], ctx.max_pages, a.rms_norm_eps, ctx.target.arch)]


def _attention(gate: bool):
    def rule(ctx, e):
        at, page = ctx.spec.model.attention, e.params["page_size"]
        if ctx.prefill:
            return [attn_prefill.make_key(at.num_heads, at.num_kv_heads, at.head_dim, ctx.t, ctx.kv_dtype,
                                          ctx.max_pages, ctx.target, gate, page)]
        dec = attn_decode.make_key(at.num_heads, at.num_kv_heads, at.head_dim, ctx.b, ctx.t, ctx.kv_dtype,
                                   ctx.max_pages, ctx.target, gate, page)
        return [dec] + ([attn_combine.for_decode(dec)] if dec.splits > 1 else [])
    return rule


RULES: dict[str, Callable[[_Ctx, Eqn], list]] = {
    "embed": _embed, "linear": _linear, "linear_residual": _linear_residual, "linear_silu_mul": _linear_silu_mul,
    "rmsnorm": _norm(False), "add_rmsnorm": _norm(True), "gdn_conv": _gdn_conv, "gdn_step": _gdn_step,
    "gated_rmsnorm": _gated_rmsnorm, "kv_append": _kv_append, "paged_attention": _attention(False),
    "gated_paged_attention": _attention(True), "linear_residual_norm": _linear_residual_norm,
    "scaled_linear": _scaled(_linear), "scaled_linear_silu_mul": _scaled(_linear_silu_mul),
    "linear_conv": _with_conv(_linear), "scaled_linear_conv": _with_conv(_scaled(_linear)),
}


class LoweringError(ValueError):
    pass


def _names(g: Graph) -> dict[int, str]:
    names = {v.uid: f"in:{k}" for k, v in g.inputs.items()}
    names.update({v.uid: f"w:{k}" for k, v in g.weights.items()})
    names.update({v.uid: f"s:{k}" for k, v in g.state.items()})
    return names


def _allocate(g: Graph, names: dict[int, str], dtypes: dict[int, str] | None = None) -> tuple[dict, int, dict]:
    """First-fit arena offsets for every non-view value, live from its producer to its last reader
    (through views); graph outputs live to the end. `dtypes` overrides a value's dtype where its
    kernel writes a wider one than the graph says (fp32 GEMV outputs, the GDN step's fp32 output)."""
    dtypes = dtypes or {}
    base: dict[int, int] = {}              # view uid → base uid
    start, end, size = {}, {}, {}
    for i, e in enumerate(g.eqns):
        for x in e.inputs:
            if isinstance(x, Var):
                end[base.get(x.uid, x.uid)] = i
        for o in e.outputs:
            if e.prim in VIEWS:
                base[o.uid] = base.get(e.inputs[0].uid, e.inputs[0].uid)
            else:
                start[o.uid], end[o.uid] = i, i
                size[o.uid] = _nbytes(o, dtypes.get(o.uid))
    for v in g.outputs.values():
        end[base.get(v.uid, v.uid)] = len(g.eqns)
    active: list[tuple[int, int, int]] = []   # (offset, bytes, end)
    arena, live, top = {}, {}, 0
    for uid in sorted(start, key=start.get):
        active = [a for a in active if a[2] >= start[uid]]
        offset = 0
        for off, nbytes, _ in sorted(active):
            if offset + size[uid] <= off:
                break
            offset = max(offset, off + nbytes)
        active.append((offset, size[uid], end[uid]))
        arena[f"a:{uid}"] = (offset, size[uid])
        live[f"a:{uid}"] = (start[uid], end[uid])
        names[uid] = f"a:{uid}"
        top = max(top, offset + size[uid])
    for view, b in base.items():
        names[view] = names.get(b, f"a:{b}")
    return arena, top, live


def _nbytes(v: Var, dtype: str | None = None) -> int:
    n = 1
    for d in v.shape:
        n *= d
    return -(-n * DTYPE_BYTES[dtype or v.dtype] // ALIGN) * ALIGN


def kernel_dtype(keys) -> str | None:
    """The dtype the kernels of one equation write to its output, where it differs from the graph's."""
    for key in keys:
        if key.family in MATMUL_FAMILIES and key.out_dtype == "f32":
            return "f32"
        if key.family in ("gdn_step", "gdn_chunk"):
            return "f32"
    return None


def lower(g: Graph, spec: ModelSpec, target: Target) -> Plan:
    """Lower a fused graph (after `passes.run_pipeline`) for one target card."""
    table = {t.name: t for t in tensor_table(spec)}
    ctx = _Ctx(spec, target, g, {v.uid: format_of(spec, table[k]) for k, v in g.weights.items()},
               {v.uid: k for k, v in g.weights.items()})
    names = _names(g)
    keys: dict[int, list] = {}
    for i, e in enumerate(g.eqns):
        if e.prim in VIEWS or e.prim in ABSORBED:
            continue
        if e.prim not in RULES:
            raise LoweringError(f"no lowering rule for primitive {e.prim!r} (eqn {i}); run the pass pipeline first")
        keys[i] = RULES[e.prim](ctx, e)
    dtypes = {e.outputs[0].uid: dt for i, e in enumerate(g.eqns)
              if i in keys and e.outputs and (dt := kernel_dtype(keys[i]))}
    arena, arena_bytes, live = _allocate(g, names, dtypes)
    plan = Plan(g.name, target.name, [], arena, arena_bytes, live,
                dtypes={names[u]: d for u, d in dtypes.items()}, graph=g)
    permuted = None                  # (key, input) the xperm workspace holds (only xperm writes it)
    for i, e in enumerate(g.eqns):
        if e.prim in ABSORBED:
            plan.absorbed[f"{e.prim}→{ABSORBED[e.prim]}"] += 1
        if i not in keys:
            continue
        ins = tuple(names[x.uid] for x in e.inputs if isinstance(x, Var))
        outs = tuple(names[o.uid] for o in e.outputs)
        for key in keys[i]:
            if key.family == "xperm":    # projections of one input (qkv, z; q, k, v) share one xperm
                if permuted == (key, ins[0]):
                    continue
                permuted = (key, ins[0])
            plan.calls.append(Call(key, module_of(key).launch(key, target), i, ins, outs))
    return plan
