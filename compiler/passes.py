"""passes: pure Graph → Graph rewrites in one ordered pipeline — the fusions that matter for decode
(residual add into the projection's epilogue or into RMSNorm, SiLU·mul into a fused gate/up GEMV,
q/k norm + RoPE, GDN gates into the recurrent step, the output gate into attention, a decode step's
RMSNorms split over the projections around them, the GDN conv into the qkv projection of a one-token
step, a GGUF file's tiled value-head order into the GDN output norm) and dead code.

Each fused primitive's reference is the composition it replaces, so the interpreter checks every pass
(fused graph == original graph), bit for bit — except the norm fold, which moves the norm's scale past
the projection: exact in real arithmetic, one bf16 rounding different, checked to a tolerance.
`CompileOptions.debug = 2` prints the graph after each pass; `pipeline(options)` gives the passes in order.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .ir import AVal, Eqn, Graph, Var
from .options import CompileOptions
from .prims import PRIMS
from .typecheck import typecheck

Pass = Callable[[Graph], Graph]


def _uses(g: Graph) -> dict[int, int]:
    count: dict[int, int] = {}
    for e in g.eqns:
        for x in e.inputs:
            if isinstance(x, Var):
                count[x.uid] = count.get(x.uid, 0) + 1
    for v in g.outputs.values():
        count[v.uid] = count.get(v.uid, 0) + 1
    return count


def _readers(g: Graph) -> dict[int, list[int]]:
    """value uid → the equations reading it, in order."""
    out: dict[int, list[int]] = {}
    for i, e in enumerate(g.eqns):
        for x in e.inputs:
            if isinstance(x, Var):
                out.setdefault(x.uid, []).append(i)
    return out


def _producers(g: Graph) -> dict[int, int]:
    return {o.uid: i for i, e in enumerate(g.eqns) for o in e.outputs}


def rewrite(g: Graph, match: Callable[[Graph, int, dict, dict], tuple[Eqn, set[int]] | None]) -> Graph:
    """Walk equations; `match(g, i, uses, producers)` may return a fused equation placed at i and the
    indices of the equations it absorbs."""
    uses, prod = _uses(g), _producers(g)
    dropped: set[int] = set()
    out: list[tuple[int, Eqn]] = []
    for i, e in enumerate(g.eqns):
        if i in dropped:
            continue
        hit = match(g, i, uses, prod)
        if hit is None:
            out.append((i, e))
            continue
        fused, absorbed = hit
        dropped |= absorbed
        out.append((i, fused))
    return replace(g, eqns=[e for i, e in out if i not in dropped])


def single_use_producer(g, var, prim, uses, prod) -> Eqn | None:
    if not isinstance(var, Var) or uses.get(var.uid) != 1 or var.uid not in prod:
        return None
    e = g.eqns[prod[var.uid]]
    return e if e.prim == prim else None


def fuse_producer(g: Graph, consumer: str, arg: int, producer: str,
                  fused: Callable[[Eqn, Eqn], Eqn]) -> Graph:
    """Every `consumer` eqn whose input `arg` is the single-use output of a `producer` eqn → `fused(consumer eqn,
    producer eqn)`, one eqn in place of both (the producer is dropped)."""
    def match(g, i, uses, prod):
        e = g.eqns[i]
        p = single_use_producer(g, e.inputs[arg], producer, uses, prod) if e.prim == consumer else None
        return None if p is None else (fused(e, p), {prod[e.inputs[arg].uid]})
    return rewrite(g, match)


def fuse_linear_residual(g: Graph) -> Graph:
    """add(x, linear(h, W)) → the projection's epilogue adds the residual (o_proj, out_proj, down)."""
    return fuse_producer(g, "add", 1, "linear",
                         lambda e, lin: Eqn("linear_residual", [*lin.inputs, e.inputs[0]], {}, e.outputs))


def fuse_gate_up(g: Graph) -> Graph:
    """silu_mul(linear(h, Wg), linear(h, Wu)) → one GEMV over the fused [gate; up] weight."""
    def match(g, i, uses, prod):
        e = g.eqns[i]
        if e.prim != "silu_mul":
            return None
        gate = single_use_producer(g, e.inputs[0], "linear", uses, prod)
        up = single_use_producer(g, e.inputs[1], "linear", uses, prod)
        if gate is None or up is None or gate.inputs[0] is not up.inputs[0]:
            return None
        fused = Eqn("linear_silu_mul", [gate.inputs[0], gate.inputs[1], up.inputs[1]], {}, e.outputs)
        return fused, {prod[e.inputs[0].uid], prod[e.inputs[1].uid]}
    return rewrite(g, match)


def fuse_output_gate(g: Graph) -> Graph:
    """mul(reshape(paged_attention(q, ...)), sigmoid(gate)) → attention applies the gate in its epilogue."""
    def match(g, i, uses, prod):
        e = g.eqns[i]
        if e.prim != "mul":
            return None
        flat = single_use_producer(g, e.inputs[0], "reshape", uses, prod)
        sig = single_use_producer(g, e.inputs[1], "sigmoid", uses, prod)
        if flat is None or sig is None:
            return None
        attn = single_use_producer(g, flat.inputs[0], "paged_attention", uses, prod)
        if attn is None:
            return None
        q, bt, pos, *cache = attn.inputs
        fused = Eqn("gated_paged_attention", [q, sig.inputs[0], bt, pos, *cache], dict(attn.params), e.outputs)
        return fused, {prod[flat.inputs[0].uid], prod[e.inputs[0].uid], prod[e.inputs[1].uid]}
    return rewrite(g, match)


def fuse_add_rmsnorm(g: Graph) -> Graph:
    """add(x, y) followed by rmsnorm of the sum → one kernel giving both the sum and the norm."""
    def match(g, i, uses, prod):
        e = g.eqns[i]
        if e.prim != "rmsnorm" or e.inputs[0].uid not in prod:
            return None
        j = prod[e.inputs[0].uid]
        add = g.eqns[j]
        total = add.outputs[0] if add.prim == "add" else None
        if total is None or any(total in g.eqns[k].inputs for k in range(j + 1, i)):
            return None  # the fused kernel runs at the norm's place: nothing between may read the sum
        fused = Eqn("add_rmsnorm", [*add.inputs, e.inputs[1]], dict(e.params), [add.outputs[0], e.outputs[0]])
        return fused, {j}
    return rewrite(g, match)


def fuse_silu_mul(g: Graph) -> Graph:
    def match(g, i, uses, prod):
        e = g.eqns[i]
        if e.prim != "mul":
            return None
        act = single_use_producer(g, e.inputs[0], "silu", uses, prod)
        if act is None:
            return None
        return Eqn("silu_mul", [act.inputs[0], e.inputs[1]], {}, e.outputs), {prod[e.inputs[0].uid]}
    return rewrite(g, match)


def fuse_norm_rope(g: Graph) -> Graph:
    """rmsnorm → rope (or mrope: its `section` param comes along) → norm_rope."""
    def match(g, i, uses, prod):
        e = g.eqns[i]
        if e.prim not in ("rope", "mrope"):
            return None
        norm = single_use_producer(g, e.inputs[0], "rmsnorm", uses, prod)
        if norm is None:
            return None
        params = {**norm.params, **e.params}
        return Eqn("norm_rope", [norm.inputs[0], norm.inputs[1], e.inputs[1]], params, e.outputs), \
            {prod[e.inputs[0].uid]}
    return rewrite(g, match)


GATED_RECURRENCES = {"gdn_recurrence": "gdn_step", "gdn_recurrence_record": "gdn_step_record",
                     "gdn_recurrence_snapshot": "gdn_step_snapshot"}


def fuse_gdn_gates(g: Graph) -> Graph:
    """gdn_gates → reshapes → gdn_recurrence (or its record mode): the step computes its own gates from
    raw a, b."""
    def match(g, i, uses, prod):
        e = g.eqns[i]
        if e.prim not in GATED_RECURRENCES:
            return None
        rg = single_use_producer(g, e.inputs[3], "reshape", uses, prod)
        rb = single_use_producer(g, e.inputs[4], "reshape", uses, prod)
        if rg is None or rb is None or rg.inputs[0].uid not in prod:
            return None
        gates = g.eqns[prod[rg.inputs[0].uid]]
        if gates.prim != "gdn_gates" or rb.inputs[0] is not gates.outputs[1] or uses[gates.outputs[0].uid] != 1:
            return None
        q, k, v, _, _, *rest = e.inputs
        fused = Eqn(GATED_RECURRENCES[e.prim], [q, k, v, *gates.inputs, *rest], {}, e.outputs)
        return fused, {prod[rg.inputs[0].uid], prod[e.inputs[3].uid], prod[e.inputs[4].uid]}
    return rewrite(g, match)


FOLDS_INTO = {"gdn_conv_record": ("gdn_conv_fold", "gdn_conv_commit_record", 2),      # record prim → (its fold,
              "gdn_step_record": ("gdn_fold", "gdn_step_commit_record", 7)}          # the fused prim, state input)


def fuse_fold_into_verify(g: Graph) -> Graph:
    """A verify that folds the previous round's records first (trace fold_from): gdn_conv_fold → gdn_conv_record
    and gdn_fold → gdn_step_record on the same history / state and slots, nothing between touching it → one
    equation at the record's place (the kernels' commit_record modes: fold, then verify, one state pass)."""
    folds = {}                                     # (state uid, slots uid) → index of the last fold of it
    for i, e in enumerate(g.eqns):
        if e.prim in ("gdn_conv_fold", "gdn_fold"):
            folds[(e.inputs[0].uid, e.inputs[1].uid)] = i

    def touches(e, uid: int) -> bool:
        return any(isinstance(x, Var) and x.uid == uid for x in (*e.inputs, *e.outputs))

    def match(g, i, uses, prod):
        e = g.eqns[i]
        if e.prim not in FOLDS_INTO:
            return None
        fold_prim, fused_prim, at = FOLDS_INTO[e.prim]
        state, slots = e.inputs[at], e.inputs[at + 1]
        j = folds.get((state.uid, slots.uid))
        if j is None or j > i or g.eqns[j].prim != fold_prim or any(touches(x, state.uid) for x in g.eqns[j + 1:i]):
            return None
        _, _, *prev, counts = g.eqns[j].inputs
        return Eqn(fused_prim, [*e.inputs, *prev, counts], dict(e.params), e.outputs), {j}
    return rewrite(g, match)


ATTENTION_CACHE_AT = {"paged_attention": 3, "gated_paged_attention": 4}    # where an attention's cache inputs start


def fuse_qk_rope_kv(g: Graph) -> Graph:
    """A layer's norm_rope(q) and norm_rope(k) → reshape → kv_append, where the attention over that cache
    reads the reshaped roped q → one equation at q's place (qk_rope_kv): the kernel that norms and ropes
    both and appends K/V to the pages, its output the roped q. Nothing between may touch the cache."""
    readers = _readers(g)
    appends = {tuple(x.uid for x in e.inputs[4:]): i for i, e in enumerate(g.eqns) if e.prim == "kv_append"}

    def only_reader(v, uses) -> Eqn | None:
        got = readers.get(v.uid, [])
        return g.eqns[got[0]] if uses.get(v.uid) == 1 and len(got) == 1 else None

    def match(g, i, uses, prod):
        qn = g.eqns[i]
        flat = only_reader(qn.outputs[0], uses) if qn.prim == "norm_rope" else None
        attn = only_reader(flat.outputs[0], uses) if flat is not None and flat.prim == "reshape" else None
        if attn is None or attn.prim not in ATTENTION_CACHE_AT or attn.inputs[0] is not flat.outputs[0]:
            return None
        cache = attn.inputs[ATTENTION_CACHE_AT[attn.prim]:]
        j = appends.get(tuple(x.uid for x in cache))
        append = g.eqns[j] if j is not None and j > i else None
        k_flat = append and single_use_producer(g, append.inputs[0], "reshape", uses, prod)
        kn = k_flat and single_use_producer(g, k_flat.inputs[0], "norm_rope", uses, prod)
        if kn is None or kn.params != qn.params or kn.inputs[2] is not qn.inputs[2]:
            return None
        k, v, q_norm, k_norm = kn.inputs[0], append.inputs[1], qn.inputs[1], kn.inputs[1]
        if any(prod.get(x.uid, -1) >= i for x in (k, v)):
            return None                   # the fused equation runs at q's place: its inputs must exist there
        cache_ids = {x.uid for x in cache}
        if any(x.uid in cache_ids for e in g.eqns[i + 1:j] for x in e.inputs if isinstance(x, Var)):
            return None
        fused = Eqn("qk_rope_kv", [qn.inputs[0], k, v, q_norm, k_norm, qn.inputs[2], *append.inputs[2:]],
                    {**qn.params, "page_size": append.params["page_size"]}, qn.outputs)
        return fused, {prod[k_flat.inputs[0].uid], prod[append.inputs[0].uid], j}
    return rewrite(g, match)


def fuse_tiled_heads(g: Graph) -> Graph:
    """transpose(reshape(gated_rmsnorm(o, z, w)), (0, 2, 1, 3)) → gated_rmsnorm_tiled: the norm writes each
    value head at its place in llama.cpp's tiled order (the out_proj columns of a GGUF k-quant file,
    spec out_head_order: tiled), so the permutation costs no kernel and no copy."""
    def match(g, i, uses, prod):
        e = g.eqns[i]
        if e.prim != "transpose" or tuple(e.params["perm"]) != (0, 2, 1, 3):
            return None
        flat = single_use_producer(g, e.inputs[0], "reshape", uses, prod)
        norm = flat and single_use_producer(g, flat.inputs[0], "gated_rmsnorm", uses, prod)
        if not norm:
            return None
        n, nk, grp, dv = flat.outputs[0].shape
        if norm.outputs[0].shape != (n, nk * grp, dv):
            return None
        fused = Eqn("gated_rmsnorm_tiled", list(norm.inputs), {**norm.params, "key_heads": nk}, e.outputs)
        return fused, {prod[e.inputs[0].uid], prod[flat.inputs[0].uid]}
    return rewrite(g, match)


NORM_FOLD_ROWS = 32          # decode, verify and cohort steps: every projection there is a GEMV
NORM_READERS = {"linear": "scaled_linear", "linear_silu_mul": "scaled_linear_silu_mul"}


def fold_norms_into_projections(g: Graph) -> Graph:
    """rmsnorm(h) where h comes from a residual projection and only projections read the norm → the
    producer also writes xn = h·(1 + w) and Σ h² per 16-column tile (linear_residual_norm), and each
    reader scales its products by rsqrt(Σ / H + eps) (scaled_linear, scaled_linear_silu_mul). In a
    decode step that removes the one-block norm kernel between two GEMVs; the sums are fp32 and their
    order is fixed by the shapes, so every reader of a row applies the same scale. Steps of up to
    NORM_FOLD_ROWS rows (not prefill); norms that are graph outputs (the final-norm hidden) or have
    other readers stay."""
    p = g.params
    if p.get("entry") == "prefill" or \
            p.get("batch", 1) * p.get("tokens", 1) > NORM_FOLD_ROWS:
        return g
    readers, outputs, prod = _readers(g), {v.uid for v in g.outputs.values()}, _producers(g)
    producers: dict[int, Eqn] = {}             # producer index → its linear_residual_norm
    consumers: dict[int, Eqn] = {}             # reader index → its scaled projection
    dropped: set[int] = set()
    for i, e in enumerate(g.eqns):
        h, y = e.inputs[0] if e.inputs else None, e.outputs[0] if e.outputs else None
        if e.prim != "rmsnorm" or e.params["offset"] != 1.0 or y.uid in outputs or h.uid not in prod:
            continue
        j = prod[h.uid]
        if g.eqns[j].prim != "linear_residual" or j in producers or h.shape[-1] % 16:
            continue
        uses = readers.get(y.uid, [])
        if not uses or not all(g.eqns[u].prim in NORM_READERS and g.eqns[u].inputs[0] is y
                               and sum(x is y for x in g.eqns[u].inputs) == 1 for u in uses):
            continue
        xn, ssq = Var(y.aval, "xn"), Var(AVal((h.shape[0], h.shape[1] // 16), "f32"), "ssq")
        lin = g.eqns[j]
        producers[j] = Eqn("linear_residual_norm", [*lin.inputs, e.inputs[1]], {"offset": 1.0}, [h, xn, ssq])
        for u in uses:
            r = g.eqns[u]
            consumers[u] = Eqn(NORM_READERS[r.prim], [xn, ssq, *r.inputs[1:]], {"eps": e.params["eps"]}, r.outputs)
        dropped.add(i)
    if not dropped:
        return g
    eqns = [producers.get(i) or consumers.get(i) or e for i, e in enumerate(g.eqns) if i not in dropped]
    return replace(g, eqns=eqns)


CONV_PROJECTIONS = {"linear": "linear_conv", "scaled_linear": "scaled_linear_conv"}


def fold_conv_into_projection(g: Graph) -> Graph:
    """gdn_conv(reshape(linear(h, W_qkv))) over one token per row → the projection's epilogue runs the
    conv (linear_conv, scaled_linear_conv): every channel's new column is one output of the GEMV, so
    the conv and the history shift need nothing from other outputs. Same arithmetic, same bits."""
    readers = _readers(g)

    def only_reader(v, uses):
        """The one equation reading v (not a graph output), else None."""
        got = readers.get(v.uid, [])
        return got[0] if uses.get(v.uid) == 1 and len(got) == 1 else None

    def match(g, i, uses, prod):
        # matched at the projection, so it keeps its launch order among the layer's input projections
        lin = g.eqns[i]
        at = only_reader(lin.outputs[0], uses) if lin.prim in CONV_PROJECTIONS else None
        if at is None or g.eqns[at].prim != "reshape":
            return None
        flat = g.eqns[at]
        j = only_reader(flat.outputs[0], uses)
        if j is None:
            return None
        conv = g.eqns[j]
        if conv.prim != "gdn_conv" or conv.inputs[0] is not flat.outputs[0] or conv.inputs[0].shape[1] != 1 \
                or conv.inputs[2] is None:
            return None
        fused = Eqn(CONV_PROJECTIONS[lin.prim], [*lin.inputs, *conv.inputs[1:]], dict(lin.params), conv.outputs)
        return fused, {at, j}
    return rewrite(g, match)


def dead_code(g: Graph) -> Graph:
    live = {v.uid for v in g.outputs.values()}
    keep = []
    for e in reversed(g.eqns):
        if PRIMS[e.prim].effectful or any(o.uid in live for o in e.outputs):
            keep.append(e)
            live |= {x.uid for x in e.inputs if isinstance(x, Var)}
    return replace(g, eqns=keep[::-1])


def pipeline(options: CompileOptions = CompileOptions()) -> list[Pass]:
    """The passes in order; the decode folds only where `options` keep them (A/B measurements)."""
    folds = ([fold_norms_into_projections] if options.norm_fold else []) + \
        ([fold_conv_into_projection] if options.conv_fold else [])
    return [fuse_linear_residual, fuse_add_rmsnorm, fuse_silu_mul, fuse_gate_up, fuse_norm_rope, fuse_gdn_gates,
            fuse_fold_into_verify, fuse_output_gate, fuse_qk_rope_kv, fuse_tiled_heads, *folds, dead_code]


def run_pipeline(g: Graph, options: CompileOptions = CompileOptions(), passes: list[Pass] | None = None) -> Graph:
    """The passes in order (`pipeline(options)` unless given), type-checking the result (after every pass
    with `options.debug` ≥ 1: a check costs as much as a pass, and a warm `ninfer-gen build` runs a
    pipeline per bucket)."""
    for p in pipeline(options) if passes is None else passes:
        g = p(g)
        if options.debug >= 1:
            typecheck(g)
        if options.debug >= 2:
            print(f"# after {p.__name__}\n{g}")
    if not options.debug:
        typecheck(g)
    return g
