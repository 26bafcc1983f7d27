"""ops: the operations the model program is written against, and its two interpreters — eager
(torch references, differentiable: used for training and as a direct oracle) and tracing (records a Graph).

The model program never knows which one runs it.
"""
from __future__ import annotations

from .ir import AVal, Eqn, Lit, Var
from .prims import PRIMS


class Ops:
    """Front end of every primitive; subclasses implement `bind`."""

    act_dtype = "f32"

    def bind(self, prim: str, *inputs, **params) -> list:
        raise NotImplementedError

    def _one(self, prim, *inputs, **params):
        return self.bind(prim, *inputs, **params)[0]

    def embed(self, ids, table):
        return self._one("embed", ids, table, dtype=self.act_dtype)

    def linear(self, x, w):
        return self._one("linear", x, w)

    def rmsnorm(self, x, w, eps, zero_centred=True):
        return self._one("rmsnorm", x, w, eps=eps, offset=1.0 if zero_centred else 0.0)

    def gated_rmsnorm(self, x, z, w, eps):
        return self._one("gated_rmsnorm", x, z, w, eps=eps)

    def add(self, a, b):
        return self._one("add", a, b)

    def mul(self, a, b):
        return self._one("mul", a, b)

    def silu(self, x):
        return self._one("silu", x)

    def sigmoid(self, x):
        return self._one("sigmoid", x)

    def reshape(self, x, *shape):
        return self._one("reshape", x, shape=tuple(shape))

    def slice(self, x, axis, start, stop):
        return self._one("slice", x, axis=axis, start=start, stop=stop)

    def concat(self, xs, axis):
        return self._one("concat", *xs, axis=axis)

    def transpose(self, x, perm):
        return self._one("transpose", x, perm=tuple(perm))

    def positions(self, pos, tokens):
        return self._one("positions", pos, tokens=tokens)

    def rope(self, x, pos, rotary_dim, theta):
        return self._one("rope", x, pos, rotary_dim=rotary_dim, theta=theta)

    def gdn_conv(self, c, w, history, slots):
        return self._one("gdn_conv", c, w, history, slots)

    def gdn_gates(self, a, b, a_log, dt_bias):
        return tuple(self.bind("gdn_gates", a, b, a_log, dt_bias))

    def gdn_recurrence(self, q, k, v, g, beta, state, slots):
        return self._one("gdn_recurrence", q, k, v, g, beta, state, slots)

    def gdn_conv_record(self, c, w, history, slots, rec):
        return self._one("gdn_conv_record", c, w, history, slots, rec)

    def gdn_recurrence_record(self, q, k, v, g, beta, state, slots, rec_k, rec_v, rec_g):
        return self._one("gdn_recurrence_record", q, k, v, g, beta, state, slots, rec_k, rec_v, rec_g)

    def gdn_recurrence_snapshot(self, q, k, v, g, beta, state, slots, snaps):
        return self._one("gdn_recurrence_snapshot", q, k, v, g, beta, state, slots, snaps)

    def gdn_snapshot_restore(self, state, slots, snaps, counts):
        self.bind("gdn_snapshot_restore", state, slots, snaps, counts)

    def gdn_conv_fold(self, history, slots, rec, counts):
        self.bind("gdn_conv_fold", history, slots, rec, counts)

    def gdn_fold(self, state, slots, rec_k, rec_v, rec_g, counts):
        self.bind("gdn_fold", state, slots, rec_k, rec_v, rec_g, counts)

    def causal_attention(self, q, k, v, scale):
        return self._one("causal_attention", q, k, v, scale=scale)

    def kv_append(self, k, v, block_table, pos, cache, page_size):
        self.bind("kv_append", k, v, block_table, pos, *cache, page_size=page_size)

    def paged_attention(self, q, block_table, pos, cache, page_size, scale):
        return self._one("paged_attention", q, block_table, pos, *cache, page_size=page_size, scale=scale)

    # ---------------------------------------------------------------- the vision encoder (compiler.vision_model)

    def linear_bias(self, x, w, b):
        return self._one("linear_bias", x, w, b)

    def layernorm(self, x, w, b, eps):
        return self._one("layernorm", x, w, b, eps=eps)

    def gelu(self, x, approximate):
        return self._one("gelu", x, approximate=approximate)

    def pos_embed_bilinear(self, table, coords, side):
        return self._one("pos_embed_bilinear", table, coords, side=side, dtype=self.act_dtype)

    def rope_2d(self, x, coords, theta):
        return self._one("rope_2d", x, coords, theta=theta)

    def segment_attention(self, q, k, v, cu_seqlens, scale):
        return self._one("segment_attention", q, k, v, cu_seqlens, scale=scale)

    def embed_images(self, x, ids, images, token_id):
        return self._one("embed_images", x, ids, images, token_id=token_id)

    def mrope(self, x, pos3, rotary_dim, theta, section):
        return self._one("mrope", x, pos3, rotary_dim=rotary_dim, theta=theta, section=tuple(section))

    def all_reduce(self, x, tp):
        return self._one("all_reduce", x, tp=tp)

    def all_gather(self, x, tp):
        return self._one("all_gather", x, tp=tp)


class EagerOps(Ops):
    """Runs each primitive's torch reference immediately."""

    def __init__(self, act_dtype: str = "f32"):
        self.act_dtype = act_dtype

    def bind(self, prim, *inputs, **params):
        return PRIMS[prim].apply(*inputs, **params)


class TraceOps(Ops):
    """Records equations; values are `Var`s, shapes come from the primitives' shape rules."""

    def __init__(self, act_dtype: str = "f32"):
        self.act_dtype = act_dtype
        self.eqns: list[Eqn] = []

    def bind(self, prim, *inputs, **params):
        avals = [x.aval if isinstance(x, Var) else x for x in inputs]
        outs = [Var(a) for a in PRIMS[prim].shape_rule(*avals, **params)]
        ins = [x if (x is None or isinstance(x, Var)) else Lit(x) for x in inputs]
        self.eqns.append(Eqn(prim, ins, dict(params), outs))
        return outs

    def new_var(self, shape, dtype, hint="") -> Var:
        return Var(AVal(tuple(shape), dtype), hint)
