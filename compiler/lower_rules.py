"""lower_rules: one lowering rule per primitive (`RULES`) — the kernel calls an equation launches, each
with its key and a binding for every kernel parameter (plan.Arena via `Val`, step input, weight plane,
state buffer, workspace, constant, null). A rule may instead launch nothing: views (reshape, slice)
alias their input, `positions` is the `row_pos` step input. Matrix-multiply dispatch (skinny GEMV up to
32 rows, else the prefill GEMM — Hopper warpgroup MMA behind an activation permute where the arch and
format allow) lives here; the GDN layers' rules are lower_gdn's, the vision encoder's lower_vision's, what every
rule works with lower_ctx's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable

from .ir import Eqn, Var
from .kernels import (KernelKey, attn_combine, attn_decode, attn_prefill, concat, embed, embed_images, gated_rmsnorm,
                      gemm, gemm_wg, gemv, gemv_rules, qk_rope_kv, rmsnorm, xperm)
from .lower_ctx import Arg, Ctx, Lowered, LoweringError, Val
from .lower_gdn import GDN_RULES
from .lower_vision import VISION_RULES
from .plan import NULL, Collective, Const, Input, State, Weight
from .spec import DRAFT_HEAD
from .targets import Target
from .weights import gate_up_name

EMBEDDING = "embed_tokens.weight"


# ---------------------------------------------------------------------------------------------- matmul
@lru_cache(maxsize=4096)        # a forward multiplies a few shapes hundreds of times; a key is immutable
def matmul_key(fmt: str, n: int, k: int, m: int, target: Target, epilogue: str = "none",
               out_dtype: str = "bf16") -> KernelKey:
    """The skinny GEMV up to 32 rows (decode, verify, cohorts, a prefill's last-token head), the prefill
    GEMM above: on Hopper warpgroup MMA where the arch and format allow (gemm_wg; never a GGUF k-quant),
    else mma.sync. The shipped key: experiment rules apply in `_matmul`, after the passes' folds."""
    if m <= 32:
        return gemv.make_key(fmt, n, k, m, target, epilogue, out_dtype)
    make = gemm_wg.make_key if gemm_wg.eligible(fmt, n, k, m, target) else gemm.make_key
    return make(fmt, n, k, m, target, epilogue, out_dtype)


@dataclass(frozen=True)
class Folds:
    """Work a pass moved into a decode projection: the gemv key fields it sets and the bindings it adds."""
    fields: tuple = ()
    args: tuple = ()

    def __or__(self, other: "Folds") -> "Folds":
        return Folds(self.fields + other.fields, self.args + other.args)


NO_FOLDS = Folds()


def _matmul(ctx: Ctx, e: Eqn, x: Var, weights: list[Var], epilogue: str = "none", res: Var | None = None,
            folds: Folds = NO_FOLDS) -> Lowered:
    """One matrix multiply y = epilogue(x·Wᵀ); `weights` [gate, up] for silu_mul (one fused device matrix)."""
    w = weights[0]
    name = ctx.weight_name[w.uid] if len(weights) == 1 else gate_up_name(ctx.weight_name[w.uid])
    n = w.shape[0] * len(weights)
    # the vocabulary heads and the tiny a/b projections write fp32 (logits; the GDN gates read fp32)
    out = "f32" if epilogue == "none" and (name in ("lm_head.weight", EMBEDDING, DRAFT_HEAD) or n < 64) else "bf16"
    fmt = ctx.weight_format[w.uid]
    key = matmul_key(fmt, n, w.shape[1], x.shape[0], ctx.target, epilogue, out)
    if folds.fields:
        if key.family != "gemv":
            raise LoweringError(f"{e.prim}: needs the decode GEMV (M = {x.shape[0]} rows), not a prefill GEMM")
        key = replace(key, **dict(folds.fields))
    if key.family == "gemv" and ctx.options.gemv:   # experiment rules, judged by the key's checks with its folds
        key = gemv_rules.apply_overrides(key, ctx.options.gemv)
    args: dict[str, Arg] = {"y": Val(e.outputs[0]), "x": Val(x), **ctx.planes(name, fmt),
                            "res": NULL if res is None else Val(res), **dict(folds.args)}
    out_dtype = out if out == "f32" else None
    if key.family == "gemv":
        args |= {"ws": NULL, "tickets": NULL} | ctx.workspace(key)
    if key.family != "gemm_wg":
        return Lowered([(key, args)], out_dtype=out_dtype)
    perm = xperm.make_key(x.shape[0], w.shape[1], ctx.target)
    xp = ctx.workspace(perm)["xp"]           # xperm writes it, gemm_wg reads it as x (one region, lane 0)
    calls = [] if ctx.scratch == (perm, x.uid) else [(perm, {"xp": xp, "x": Val(x)})]
    return Lowered(calls + [(key, args | {"x": xp})], out_dtype=out_dtype, scratch=(perm, x.uid))


def _projection(epilogue: str):
    """linear (epilogue none) or linear_silu_mul over (x, W…), with the folds a wrapper adds."""
    def rule(ctx, e, folds: Folds = NO_FOLDS):
        weights = list(e.inputs[1:2] if epilogue == "none" else e.inputs[1:3])
        return _matmul(ctx, e, e.inputs[0], weights, epilogue, folds=folds)
    return rule


def _linear_residual(ctx, e):
    return _matmul(ctx, e, e.inputs[0], [e.inputs[1]], "residual", res=e.inputs[2])


def _linear_residual_norm(ctx, e):
    """(x, W, residual, norm weight) → h, xn, ssq: the residual GEMV also writes the next norm's input."""
    if e.params["offset"] != 1.0:
        raise LoweringError(f"{e.prim}: the GEMV normalises with (1 + w) only, not offset {e.params['offset']}")
    x, w, res, norm_w = e.inputs
    folds = Folds((("norm_out", True),), (("xn", Val(e.outputs[1])), ("ssq_out", Val(e.outputs[2])),
                                         ("norm_w", Val(norm_w))))
    return _matmul(ctx, e, x, [w], "residual", res=res, folds=folds)


def _scaled(rule):
    """(xn, ssq, W…) → the projection's GEMV scaling its rows by the norm's inverse RMS (passes.fold_norms_…)."""
    def lowered(ctx, e, folds: Folds = NO_FOLDS):
        xn, ssq, *rest = e.inputs
        scale = Folds((("scale_in", True), ("eps", e.params["eps"])), (("ssq_in", Val(ssq)),))
        return rule(ctx, Eqn(e.prim, [xn, *rest], dict(e.params), e.outputs), folds | scale)
    return lowered


def _with_conv(rule):
    """(x…, W, conv taps, history, slots) → the projection's GEMV running the GDN conv in its epilogue."""
    def lowered(ctx, e, folds: Folds = NO_FOLDS):
        *head, taps, history, _ = e.inputs
        conv = Folds((("conv", taps.shape[-1]),), (("conv_w", Val(taps)),
                                                   ("hist", State(f"gdn.{ctx.layer(history)}.conv")),
                                                   ("slots", Input("slots"))))
        return rule(ctx, Eqn(e.prim, head, dict(e.params), e.outputs), folds | conv)
    return lowered


# ---------------------------------------------------------------------------------------------- the rest
def _norm(ctx, e):
    key = rmsnorm.Key(e.inputs[0].shape[-1], ctx.m, False, "bf16", e.params["eps"], ctx.target.arch)
    return Lowered([(key, {"y": Val(e.outputs[0]), "x": Val(e.inputs[0]), "delta": NULL, "w": Val(e.inputs[1])})])


def _add_norm(ctx, e):
    """The residual add and the next norm in one rmsnorm kernel (add mode), which writes the sum over x: the
    sum takes x's bytes. A single card's graphs carry the residual add on the projection instead
    (linear_residual); a tensor-parallel graph's add reads the all_reduce of the projection."""
    x, delta, w = e.inputs
    key = rmsnorm.Key(x.shape[-1], ctx.m, True, "bf16", e.params["eps"], ctx.target.arch)
    return Lowered([(key, {"y": Val(e.outputs[1]), "x": Val(x), "delta": Val(delta), "w": Val(w)})], in_place=0)


def _embed(ctx, e):
    fmt = ctx.weight_format[e.inputs[1].uid]
    key = embed.Key(fmt, e.inputs[1].shape[1], ctx.m, ctx.target.arch)
    scales = Weight(EMBEDDING, "row_scales") if fmt == "w8g32" else NULL     # bf16 and k-quant tables: rows only
    return Lowered([(key, {"y": Val(e.outputs[0]), "ids": Val(e.inputs[0]), "table": Weight(EMBEDDING, "rows"),
                           "scales": scales})])


def _gated_rmsnorm(ctx, e):
    """gated_rmsnorm, or gated_rmsnorm_tiled (its heads written in a GGUF out_proj's tiled order)."""
    _, hv, dv = e.inputs[0].shape
    key = gated_rmsnorm.Key(hv, dv, ctx.m, e.params["eps"], ctx.target.arch, e.params.get("key_heads", 0))
    o, z, w = e.inputs
    return Lowered([(key, {"y": Val(e.outputs[0]), "o": Val(o), "z": Val(z), "w": Val(w)})])


def _qk_rope_kv(ctx, e):
    """The 1-D kernel reads each row's cache position (`row_pos`) for its page slot and its rotation; with
    M-RoPE (`section`: a sequence with images) the rotation reads the rows' 3-axis positions (`rope_pos`)."""
    at, a = ctx.spec.model.attention, ctx.spec.model
    q, k, v, q_norm, k_norm, row_pos, block_table, _, *cache = e.inputs
    section = tuple(e.params.get("section", ()))
    key = qk_rope_kv.Key(at.num_heads, at.num_kv_heads, at.head_dim, at.rotary_dim, ctx.b, ctx.t, ctx.kv_dtype,
                         e.params["page_size"], ctx.max_pages, a.rms_norm_eps, ctx.target.arch, mrope=section)
    args = {"q_out": Val(e.outputs[0]), "q": Val(q), "k": Val(k), "v": Val(v), "q_norm": Val(q_norm),
            "k_norm": Val(k_norm), "inv_freq": Const("rope_inv_freq", (e.params["theta"], e.params["rotary_dim"])),
            "pos": Input("row_pos") if section else Val(row_pos), "block_table": Val(block_table)}
    if section:
        args["rope_pos"] = Val(row_pos)
    return Lowered([(key, args | ctx.pages(cache[0]))])


def _embed_images(ctx, e):
    """In place on the embedding rows: a placeholder's row takes its image token (the `image_count` step input
    says how many of the `images` rows this run holds: 0 in a decode step, so a generated placeholder id keeps
    its embedding)."""
    x, ids, images = e.inputs
    key = embed_images.Key(x.shape[1], ctx.m, images.shape[0], e.params["token_id"], ctx.target.arch)
    return Lowered([(key, {"y": Val(e.outputs[0]), "ids": Val(ids), "images": Val(images),
                           "count": Input("image_count")})], in_place=0)


def _attention(gate: bool):
    def rule(ctx, e):
        at, page = ctx.spec.model.attention, e.params["page_size"]
        q, gate_src, block_table, _, *cache = e.inputs if gate else (e.inputs[0], None, *e.inputs[1:])
        common = {"q": Val(q), "gate_src": Val(gate_src) if gate else NULL, "block_table": Val(block_table),
                  **ctx.pages(cache[0])}
        out = Val(e.outputs[0])
        if ctx.prefill:
            key = attn_prefill.make_key(at.num_heads, at.num_kv_heads, at.head_dim, ctx.t, ctx.kv_dtype,
                                        ctx.max_pages, ctx.target, gate, page)
            return Lowered([(key, common | {"out": out, "seq_len": Input("seq_lens")})])
        dec = attn_decode.make_key(at.num_heads, at.num_kv_heads, at.head_dim, ctx.b, ctx.t, ctx.kv_dtype,
                                   ctx.max_pages, ctx.target, gate, page)
        common["seq_lens"] = Input("seq_lens")
        if dec.splits == 1:
            return Lowered([(dec, common | {"out": out, "part_o": NULL, "part_ml": NULL})])
        parts = ctx.workspace(dec)        # the split partials attn_combine reduces, in the same lane
        combine = {"out": out, "part_o": parts["part_o"], "part_ml": parts["part_ml"], "gate_src": common["gate_src"],
                   "seq_lens": common["seq_lens"]}
        return Lowered([(dec, common | parts | {"out": NULL}), (attn_combine.for_decode(dec), combine)])
    return rule


def _collective(op: str):
    """all_reduce / all_gather (compiler.shard): a Collective step on the arena, in the dtype the producer
    wrote (the vocabulary head's fp32 logits, the projections' bf16)."""
    def rule(ctx, e):
        x, y = e.inputs[0], e.outputs[0]
        dtype = ctx.wide.get(x.uid, x.dtype)
        key = Collective(op, math.prod(x.shape), dtype, e.params["tp"])
        return Lowered([(key, {"x": Val(x), "y": Val(y)})], out_dtype=dtype if dtype != y.dtype else None)
    return rule


def _positions(ctx, e):
    return Lowered(alias=Input("row_pos"))


def _concat(ctx, e):
    a, b = e.inputs
    if e.params["axis"] != 1 or len(a.shape) != 2 or a.dtype != "bf16":
        raise LoweringError(f"concat: the kernel joins bf16 rows (axis 1 of [m, k]), got axis {e.params['axis']} "
                            f"of {a.aval}")
    key = concat.Key(a.shape[0], a.shape[1], b.shape[1], ctx.target.arch)
    return Lowered([(key, {"y": Val(e.outputs[0]), "a": Val(a), "b": Val(b)})])


RULES: dict[str, Callable[[Ctx, Eqn], Lowered]] = {
    "embed": _embed, "linear": _projection("none"), "linear_residual": _linear_residual,
    "linear_silu_mul": _projection("silu_mul"),
    "rmsnorm": _norm, "add_rmsnorm": _add_norm,
    "all_reduce": _collective("all_reduce"), "all_gather": _collective("all_gather"),
    "gated_rmsnorm": _gated_rmsnorm, "gated_rmsnorm_tiled": _gated_rmsnorm,
    "qk_rope_kv": _qk_rope_kv, "paged_attention": _attention(False),
    "gated_paged_attention": _attention(True), "linear_residual_norm": _linear_residual_norm,
    "scaled_linear": _scaled(_projection("none")), "scaled_linear_silu_mul": _scaled(_projection("silu_mul")),
    "linear_conv": _with_conv(_projection("none")), "scaled_linear_conv": _scaled(_with_conv(_projection("none"))),
    "positions": _positions, "concat": _concat, "embed_images": _embed_images, **GDN_RULES, **VISION_RULES,
}
