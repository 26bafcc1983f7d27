"""lower_vision: the lowering rules of the vision encoder's primitives (after compiler.passes_vision) — the tower's
projections on the bf16 prefill GEMM with the bias epilogues (gemm; mma.sync on every arch, any row count: an
encoder call's rows are patches or merged tokens, never a decode step), LayerNorm, the position grid added in
place, and the fused 2-D rotary + segment attention. compiler.lower_rules merges `VISION_RULES` into its table.
"""
from __future__ import annotations

from .ir import Eqn, Var
from .kernels import attn_vision, gemm, layernorm, pos_embed
from .lower_ctx import Ctx, Lowered, LoweringError, Val
from .plan import NULL, Const, Input

_GELU_EPILOGUE = {"tanh": "bias_gelu_tanh", "none": "bias_gelu"}


def _weight_of(ctx: Ctx, w: Var) -> Var:
    """The graph weight behind `w`, through reshapes (the patch embedding's conv kernel is a flat matrix view)."""
    producers = {o.uid: e for e in ctx.graph.eqns for o in e.outputs}
    while w.uid not in ctx.weight_name:
        e = producers.get(w.uid)
        if e is None or e.prim != "reshape":
            raise LoweringError(f"a vision projection's matrix must be a weight (or a reshape of one), got {w}")
        w = e.inputs[0]
    return w


def _linear(epilogue, ctx: Ctx, e: Eqn, res: Var | None = None) -> Lowered:
    x, w, b = e.inputs[:3]
    base = _weight_of(ctx, w)
    name, fmt = ctx.weight_name[base.uid], ctx.weight_format[base.uid]
    if fmt != "bf16" or x.dtype != "bf16":
        raise LoweringError(f"{e.prim}: the vision GEMM takes a bf16 tower and bf16 activations, got {fmt} weights "
                            f"and {x.dtype} activations (plan the encoder in bf16)")
    n, k = w.shape
    key = gemm.make_key("bf16", n, k, x.shape[0], ctx.target, epilogue)
    args = {"y": Val(e.outputs[0]), "x": Val(x), **ctx.planes(name, fmt), "bias": Val(b),
            "res": NULL if res is None else Val(res)}
    return Lowered([(key, args)])


def _linear_bias(ctx, e):
    return _linear("bias", ctx, e)


def _linear_bias_gelu(ctx, e):
    return _linear(_GELU_EPILOGUE[e.params["approximate"]], ctx, e)


def _linear_bias_residual(ctx, e):
    return _linear("bias_residual", ctx, e, res=e.inputs[3])


def _layernorm(ctx, e):
    x, w, b = e.inputs
    key = layernorm.Key(x.shape[-1], x.shape[0], e.params["eps"], ctx.target.arch)
    return Lowered([(key, {"y": Val(e.outputs[0]), "x": Val(x), "w": Val(w), "b": Val(b)})])


def _pos_embed_add(ctx, e):
    """In place on the patch embeddings (their last reader)."""
    x, table, coords = e.inputs
    key = pos_embed.Key(x.shape[1], x.shape[0], e.params["side"], ctx.target.arch)
    return Lowered([(key, {"x": Val(x), "table": Val(table), "coords": Input("coords")})], in_place=0)


def _vision_attention(ctx, e):
    qkv, _, _ = e.inputs
    heads, d = e.outputs[0].shape[1:]
    key = attn_vision.Key(heads, d, qkv.shape[0], ctx.graph.params["images"], e.params["scale"], ctx.target.arch)
    return Lowered([(key, {"out": Val(e.outputs[0]), "qkv": Val(qkv), "coords": Input("coords"),
                           "cu_seqlens": Input("cu_seqlens"),
                           "inv_freq": Const("rope2d_inv_freq", (e.params["theta"], d))})])


VISION_RULES = {"linear_bias": _linear_bias, "linear_bias_gelu": _linear_bias_gelu,
                "linear_bias_residual": _linear_bias_residual, "layernorm": _layernorm,
                "pos_embed_add": _pos_embed_add, "vision_attention": _vision_attention}
