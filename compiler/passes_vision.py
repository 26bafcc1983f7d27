"""passes_vision: the vision encoder's pass pipeline — pure Graph → Graph fusions that leave one kernel per step
of a block: GELU into its projection's epilogue, the residual add into the projection before it, the position
grid's add into its own kernel, and the qkv split + 2-D rotary + segment attention into one attention primitive;
then dead code. As compiler.passes, each fused primitive's reference is the composition it replaces
(compiler.prims_vision), so the interpreter runs the fused graph bit for bit like the traced one.
"""
from __future__ import annotations

from .ir import Eqn, Graph
from .options import CompileOptions
from .passes import Pass, dead_code, fuse_producer, rewrite, run_pipeline, single_use_producer


def fuse_linear_bias_gelu(g: Graph) -> Graph:
    """gelu(linear_bias(x, W, b)) → the projection's epilogue applies the GELU (the MLPs' fc1)."""
    return fuse_producer(g, "gelu", 0, "linear_bias",
                         lambda e, lin: Eqn("linear_bias_gelu", list(lin.inputs), dict(e.params), e.outputs))


def fuse_linear_bias_residual(g: Graph) -> Graph:
    """add(x, linear_bias(h, W, b)) → the projection's epilogue adds the residual (attn.proj, fc2)."""
    return fuse_producer(g, "add", 1, "linear_bias",
                         lambda e, lin: Eqn("linear_bias_residual", [*lin.inputs, e.inputs[0]], {}, e.outputs))


def fuse_pos_embed_add(g: Graph) -> Graph:
    """add(x, pos_embed_bilinear(table, coords)) → one kernel adds the resampled grid to x in place."""
    return fuse_producer(g, "add", 1, "pos_embed_bilinear",
                         lambda e, pos: Eqn("pos_embed_add", [e.inputs[0], *pos.inputs], dict(pos.params), e.outputs))


def _qkv_part(g, var, uses, prod):
    """(qkv, part index, heads) when `var` = reshape(slice(reshape(qkv, n, 3, heads, d), axis 1, i:i+1)), else None."""
    flat = single_use_producer(g, var, "reshape", uses, prod)
    sl = flat and single_use_producer(g, flat.inputs[0], "slice", uses, prod)
    if not sl or sl.params["axis"] != 1 or sl.params["stop"] != sl.params["start"] + 1:
        return None
    split = g.eqns[prod[sl.inputs[0].uid]] if sl.inputs[0].uid in prod else None
    if split is None or split.prim != "reshape" or len(split.outputs[0].shape) != 4 or split.outputs[0].shape[1] != 3:
        return None
    return split.inputs[0], sl.params["start"], split.outputs[0].shape[2]


def fuse_vision_attention(g: Graph) -> Graph:
    """segment_attention(rope_2d(q), rope_2d(k), v) over the q, k, v parts of one qkv projection → one
    vision_attention reading the projection's rows (the unused split views go with dead code)."""
    def match(g, i, uses, prod):
        e = g.eqns[i]
        if e.prim != "segment_attention":
            return None
        q_rot, k_rot, v, cu = e.inputs
        rq = single_use_producer(g, q_rot, "rope_2d", uses, prod)
        rk = single_use_producer(g, k_rot, "rope_2d", uses, prod)
        if rq is None or rk is None or rq.inputs[1] is not rk.inputs[1] or rq.params != rk.params:
            return None
        parts = [_qkv_part(g, x, uses, prod) for x in (rq.inputs[0], rk.inputs[0], v)]
        if None in parts or [p[1] for p in parts] != [0, 1, 2] or len({p[0].uid for p in parts}) != 1:
            return None
        qkv, _, heads = parts[0]
        params = {"heads": heads, "theta": rq.params["theta"], "scale": e.params["scale"]}
        fused = Eqn("vision_attention", [qkv, rq.inputs[1], cu], params, e.outputs)
        return fused, {prod[q_rot.uid], prod[k_rot.uid]}
    return rewrite(g, match)


def pipeline() -> list[Pass]:
    return [fuse_linear_bias_gelu, fuse_linear_bias_residual, fuse_pos_embed_add, fuse_vision_attention, dead_code]


def run_vision_pipeline(g: Graph, options: CompileOptions = CompileOptions()) -> Graph:
    """The encoder's passes in order, type-checked as compiler.passes.run_pipeline does."""
    return run_pipeline(g, options, pipeline())
