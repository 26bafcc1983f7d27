"""prims: the primitive table — one entry per primitive: shape/dtype rule and torch reference.

Adding a primitive = a shape rule here, a torch reference in `compiler.reference_ops`, a lowering rule
(with the kernel families), and one test. Effectful primitives write graph state in place. The vision encoder's
primitives keep their rules and references apart (`compiler.prims_vision`, `compiler.reference_vision`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import prims_vision
from . import reference_collectives as collective
from . import reference_fused as fused
from . import reference_ops as ref
from . import reference_replayssm as replay
from .ir import AVal


@dataclass(frozen=True)
class Primitive:
    name: str
    shape_rule: Callable[..., list[AVal]]
    reference: Callable
    effectful: bool = False

    def apply(self, *inputs, **params) -> list:
        """Run the torch reference; always a list of outputs (empty for pure effects)."""
        out = self.reference(*inputs, **params)
        if out is None:
            return []
        return list(out) if isinstance(out, tuple) else [out]


PRIMS: dict[str, Primitive] = {}


def _prim(name: str, reference: Callable, effectful: bool = False):
    def register(rule):
        PRIMS[name] = Primitive(name, rule, reference, effectful)
        return rule
    return register


def _check(cond: bool, msg) -> None:
    """`msg` is a string or a function making one: passing checks build no text (typecheck is hot)."""
    if not cond:
        raise TypeError(msg() if callable(msg) else msg)


@_prim("embed", ref.embed)
def _embed(ids, table, *, dtype):
    _check(ids.dtype == "i32" and len(ids.shape) == 1, lambda: f"embed: ids must be i32[N], got {ids}")
    return [AVal((ids.shape[0], table.shape[1]), dtype)]


@_prim("linear", ref.linear)
def _linear(x, w):
    _check(len(x.shape) == 2 and x.shape[1] == w.shape[1], lambda: f"linear: x {x} does not match weight {w}")
    return [AVal((x.shape[0], w.shape[0]), x.dtype)]


@_prim("rmsnorm", ref.rmsnorm)
def _rmsnorm(x, w, *, eps, offset):
    _check(w.shape == (x.shape[-1],), lambda: f"rmsnorm: weight {w} does not match {x}")
    return [x]


@_prim("gated_rmsnorm", ref.gated_rmsnorm)
def _gated_rmsnorm(x, z, w, *, eps):
    _check(x.shape == z.shape and w.shape == (x.shape[-1],), lambda: f"gated_rmsnorm: {x}, {z}, {w}")
    return [x]


def _same(name):
    def rule(a, b):
        _check(a.shape == b.shape and a.dtype == b.dtype, lambda: f"{name}: {a} vs {b}")
        return [a]
    return rule


def _unary(x):
    return [x]


PRIMS["add"] = Primitive("add", _same("add"), ref.add)
PRIMS["mul"] = Primitive("mul", _same("mul"), ref.mul)
PRIMS["silu"] = Primitive("silu", _unary, ref.silu)
PRIMS["sigmoid"] = Primitive("sigmoid", _unary, ref.sigmoid)


@_prim("reshape", ref.reshape)
def _reshape(x, *, shape):
    n = 1
    for d in shape:
        n *= d
    m = 1
    for d in x.shape:
        m *= d
    _check(n == m, lambda: f"reshape: {x} cannot become {shape}")
    return [AVal(tuple(shape), x.dtype)]


@_prim("slice", ref.slice_)
def _slice(x, *, axis, start, stop):
    _check(0 <= start < stop <= x.shape[axis], lambda: f"slice: [{start}:{stop}] out of {x} axis {axis}")
    shape = list(x.shape)
    shape[axis] = stop - start
    return [AVal(tuple(shape), x.dtype)]


@_prim("concat", ref.concat)
def _concat(*xs, axis):
    base = list(xs[0].shape)
    for x in xs[1:]:
        _check(len(x.shape) == len(base) and x.dtype == xs[0].dtype, lambda: f"concat: {xs}")
    base[axis] = sum(x.shape[axis] for x in xs)
    return [AVal(tuple(base), xs[0].dtype)]


@_prim("transpose", ref.transpose)
def _transpose(x, *, perm):
    _check(sorted(perm) == list(range(len(x.shape))), lambda: f"transpose: {perm} is not a permutation of {x}'s axes")
    return [AVal(tuple(x.shape[i] for i in perm), x.dtype)]


@_prim("positions", ref.positions)
def _positions(pos, *, tokens):
    _check(pos.dtype == "i32" and len(pos.shape) == 1, lambda: f"positions: start must be i32[B], got {pos}")
    return [AVal((pos.shape[0] * tokens,), "i32")]


@_prim("rope", ref.rope)
def _rope(x, pos, *, rotary_dim, theta):
    _check(len(x.shape) == 3 and pos.shape == (x.shape[0],), lambda: f"rope: {x} with positions {pos}")
    _check(rotary_dim % 2 == 0 and rotary_dim <= x.shape[2], lambda: f"rope: rotary_dim {rotary_dim} for {x}")
    return [x]


@_prim("gdn_conv", ref.gdn_conv, effectful=True)
def _gdn_conv(c, w, history, slots):
    _check(len(c.shape) == 3 and w.shape[0] == c.shape[2], lambda: f"gdn_conv: {c} with weight {w}")
    if history is not None:
        _check(history.shape[1:] == (c.shape[2], w.shape[2] - 1), lambda: f"gdn_conv: history {history}")
    return [c]


@_prim("gdn_gates", ref.gdn_gates)
def _gdn_gates(a, b, a_log, dt_bias):
    _check(a.shape == b.shape and a_log.shape == (a.shape[-1],), lambda: f"gdn_gates: {a}, {b}, {a_log}")
    return [AVal(a.shape, "f32"), AVal(a.shape, "f32")]


@_prim("gdn_recurrence", ref.gdn_recurrence, effectful=True)
def _gdn_recurrence(q, k, v, g, beta, state, slots):
    B, T, hk, dk = q.shape
    _check(k.shape == q.shape and v.shape[:2] == (B, T) and v.shape[2] % hk == 0, lambda: f"gdn: {q} {k} {v}")
    _check(g.shape == (B, T, v.shape[2]) == beta.shape, lambda: f"gdn: gates {g} {beta} for {v}")
    if state is not None:
        _check(state.shape[1:] == (v.shape[2], dk, v.shape[3]) and state.dtype == "f32", lambda: f"gdn: state {state}")
    return [v]


# ---------------------------------------------------------------- ReplaySSM (REPLAYSSM.md): verify and fold

@_prim("gdn_conv_record", replay.gdn_conv_record, effectful=True)
def _gdn_conv_record(c, w, history, slots, rec):
    _check(rec.shape == c.shape, lambda: f"gdn_conv_record: record {rec} for {c}")
    return _gdn_conv(c, w, history, slots)


@_prim("gdn_conv_fold", replay.gdn_conv_fold, effectful=True)
def _gdn_conv_fold(history, slots, rec, commit):
    _check(len(rec.shape) == 3 and history.shape[1] == rec.shape[2] and commit.shape == slots.shape
           and rec.shape[0] == slots.shape[0], lambda: f"gdn_conv_fold: {history} {rec} {commit}")
    return []


def _records(k, v, rec_k, rec_v, rec_g, name):
    B, T, hv = v.shape[:3]
    _check(rec_k.shape == k.shape and rec_v.shape == v.shape and rec_g.shape == (B, T, hv, 2)
           and rec_g.dtype == "f32", lambda: f"{name}: records {rec_k} {rec_v} {rec_g} for {k} {v}")


@_prim("gdn_recurrence_record", replay.gdn_recurrence_record, effectful=True)
def _gdn_recurrence_record(q, k, v, g, beta, state, slots, rec_k, rec_v, rec_g):
    _records(k, v, rec_k, rec_v, rec_g, "gdn_recurrence_record")
    return _gdn_recurrence(q, k, v, g, beta, state, slots)


@_prim("gdn_fold", replay.gdn_fold, effectful=True)
def _gdn_fold(state, slots, rec_k, rec_v, rec_g, commit):
    _check(state.shape[1:] == (rec_v.shape[2], rec_k.shape[3], rec_v.shape[3]) and commit.shape == slots.shape
           and rec_k.shape[0] == slots.shape[0], lambda: f"gdn_fold: {state} {rec_k} {rec_v} {commit}")
    return []


def _snapshots(v, state, snaps, name):
    B, T = v.shape[:2]
    _check(snaps.shape == (B, T, *state.shape[1:]) and snaps.dtype == "f32", lambda: f"{name}: snapshots {snaps} for {v}")


@_prim("gdn_recurrence_snapshot", replay.gdn_recurrence_snapshot, effectful=True)
def _gdn_recurrence_snapshot(q, k, v, g, beta, state, slots, snaps):
    _snapshots(v, state, snaps, "gdn_recurrence_snapshot")
    return _gdn_recurrence(q, k, v, g, beta, state, slots)


@_prim("gdn_snapshot_restore", replay.gdn_snapshot_restore, effectful=True)
def _gdn_snapshot_restore(state, slots, snaps, commit):
    _check(snaps.shape[2:] == state.shape[1:] and commit.shape == slots.shape and snaps.shape[0] == slots.shape[0],
           lambda: f"gdn_snapshot_restore: {state} {snaps} {commit}")
    return []


@_prim("causal_attention", ref.causal_attention)
def _causal_attention(q, k, v, *, scale):
    _check(k.shape == v.shape and q.shape[:2] == k.shape[:2] and q.shape[2] % k.shape[2] == 0, lambda: f"causal_attention: {q} {k} {v}")
    return [q]


@_prim("kv_append", ref.kv_append, effectful=True)
def _kv_append(k, v, block_table, pos, *cache, page_size):
    _check(k.shape == v.shape and block_table.shape[0] == k.shape[0] == pos.shape[0], lambda: f"kv_append: {k} {v}")
    _check(len(cache) in (1, 2), "kv_append: cache is (values,) or (codes, scales)")
    return []


@_prim("paged_attention", ref.paged_attention)
def _paged_attention(q, block_table, pos, *cache, page_size, scale):
    _check(len(q.shape) == 4 and block_table.shape[0] == q.shape[0], lambda: f"paged_attention: {q} {block_table}")
    _check(q.shape[2] % cache[0].shape[2] == 0, lambda: f"paged_attention: heads {q} vs cache {cache[0]}")
    return [q]


# ---------------------------------------------------------------- fused primitives (made by passes)

@_prim("add_rmsnorm", fused.add_rmsnorm)
def _add_rmsnorm(x, y, w, *, eps, offset):
    _check(x.shape == y.shape and w.shape == (x.shape[-1],), lambda: f"add_rmsnorm: {x} {y} {w}")
    return [x, x]


PRIMS["silu_mul"] = Primitive("silu_mul", _same("silu_mul"), fused.silu_mul)


@_prim("norm_rope", fused.norm_rope)
def _norm_rope(x, w, pos, *, eps, offset, rotary_dim, theta, section=()):
    _rmsnorm(x, w, eps=eps, offset=offset)
    if section:
        from .prims_vision import RULES as VISION
        return VISION["mrope"][0](x, pos, rotary_dim=rotary_dim, theta=theta, section=section)
    return _rope(x, pos, rotary_dim=rotary_dim, theta=theta)


@_prim("qk_rope_kv", fused.qk_rope_kv, effectful=True)
def _qk_rope_kv(q, k, v, q_norm, k_norm, row_pos, block_table, pos, *cache, eps, offset, rotary_dim, theta,
                page_size, section=()):
    rope_params = dict(eps=eps, offset=offset, rotary_dim=rotary_dim, theta=theta, section=section)
    (k_roped,) = _norm_rope(k, k_norm, row_pos, **rope_params)
    _check(len(k_roped.shape) == 3 and (k_roped.shape[0], *k_roped.shape[1:]) == (v.shape[0] * v.shape[1], *v.shape[2:]),
           lambda: f"qk_rope_kv: k {k} does not match v {v}")
    _kv_append(v, v, block_table, pos, *cache, page_size=page_size)
    return _norm_rope(q, q_norm, row_pos, **rope_params)


@_prim("gdn_step", fused.gdn_step, effectful=True)
def _gdn_step(q, k, v, a, b, a_log, dt_bias, state, slots):
    B, T, hv = v.shape[:3]
    _check(a.shape == b.shape == (B * T, hv), lambda: f"gdn_step: raw gates {a} {b} for {v}")
    return _gdn_recurrence(q, k, v, AVal((B, T, hv), "f32"), AVal((B, T, hv), "f32"), state, slots)


@_prim("gdn_step_record", replay.gdn_step_record, effectful=True)
def _gdn_step_record(q, k, v, a, b, a_log, dt_bias, state, slots, rec_k, rec_v, rec_g):
    _records(k, v, rec_k, rec_v, rec_g, "gdn_step_record")
    return _gdn_step(q, k, v, a, b, a_log, dt_bias, state, slots)


@_prim("gdn_conv_commit_record", replay.gdn_conv_commit_record, effectful=True)
def _gdn_conv_commit_record(c, w, history, slots, rec, prev_rec, commit):
    _gdn_conv_fold(history, slots, prev_rec, commit)
    _check(prev_rec.shape == rec.shape, lambda: f"gdn_conv_commit_record: previous records {prev_rec} for {rec}")
    return _gdn_conv_record(c, w, history, slots, rec)


@_prim("gdn_step_commit_record", replay.gdn_step_commit_record, effectful=True)
def _gdn_step_commit_record(q, k, v, a, b, a_log, dt_bias, state, slots, rec_k, rec_v, rec_g, prev_k, prev_v, prev_g,
                            commit):
    _gdn_fold(state, slots, prev_k, prev_v, prev_g, commit)
    _check((prev_k.shape, prev_v.shape, prev_g.shape) == (rec_k.shape, rec_v.shape, rec_g.shape),
           lambda: f"gdn_step_commit_record: previous records {prev_k} {prev_v} {prev_g} for {rec_k} {rec_v} {rec_g}")
    return _gdn_step_record(q, k, v, a, b, a_log, dt_bias, state, slots, rec_k, rec_v, rec_g)


@_prim("gdn_step_snapshot", replay.gdn_step_snapshot, effectful=True)
def _gdn_step_snapshot(q, k, v, a, b, a_log, dt_bias, state, slots, snaps):
    _snapshots(v, state, snaps, "gdn_step_snapshot")
    return _gdn_step(q, k, v, a, b, a_log, dt_bias, state, slots)


@_prim("linear_residual", fused.linear_residual)
def _linear_residual(x, w, residual):
    out = _linear(x, w)
    _check(out[0] == residual, lambda: f"linear_residual: residual {residual} vs {out[0]}")
    return out


@_prim("linear_silu_mul", fused.linear_silu_mul)
def _linear_silu_mul(x, w_gate, w_up):
    _check(w_gate.shape == w_up.shape, lambda: f"linear_silu_mul: {w_gate} vs {w_up}")
    return _linear(x, w_gate)


@_prim("linear_residual_norm", fused.linear_residual_norm)
def _linear_residual_norm(x, w, residual, norm_w, *, offset):
    (h,) = _linear_residual(x, w, residual)
    _check(norm_w.shape == (h.shape[1],) and h.shape[1] % 16 == 0, lambda: f"linear_residual_norm: {h} {norm_w}")
    return [h, h, AVal((h.shape[0], h.shape[1] // 16), "f32")]


def _scaled(xn, ssq, name):
    _check(ssq.dtype == "f32" and ssq.shape == (xn.shape[0], xn.shape[1] // 16),
           lambda: f"{name}: tile sums {ssq} for {xn}")


@_prim("scaled_linear", fused.scaled_linear)
def _scaled_linear(xn, ssq, w, *, eps):
    _scaled(xn, ssq, "scaled_linear")
    return _linear(xn, w)


@_prim("scaled_linear_silu_mul", fused.scaled_linear_silu_mul)
def _scaled_linear_silu_mul(xn, ssq, w_gate, w_up, *, eps):
    _scaled(xn, ssq, "scaled_linear_silu_mul")
    return _linear_silu_mul(xn, w_gate, w_up)


def _conv_after(y, conv_w, history, slots):
    (out,) = _gdn_conv(AVal((y.shape[0], 1, y.shape[1]), y.dtype), conv_w, history, slots)
    return [out]


@_prim("linear_conv", fused.linear_conv, effectful=True)
def _linear_conv(x, w, conv_w, history, slots):
    return _conv_after(_linear(x, w)[0], conv_w, history, slots)


@_prim("scaled_linear_conv", fused.scaled_linear_conv, effectful=True)
def _scaled_linear_conv(xn, ssq, w, conv_w, history, slots, *, eps):
    return _conv_after(_scaled_linear(xn, ssq, w, eps=eps)[0], conv_w, history, slots)


@_prim("gated_rmsnorm_tiled", fused.gated_rmsnorm_tiled)
def _gated_rmsnorm_tiled(x, z, w, *, eps, key_heads):
    _check(len(x.shape) == 3 and x.shape == z.shape and w.shape == (x.shape[-1],) and x.shape[1] % key_heads == 0,
           lambda: f"gated_rmsnorm_tiled: {x}, {z}, {w}, {key_heads} key heads")
    n, hv, dv = x.shape
    return [AVal((n, hv // key_heads, key_heads, dv), x.dtype)]


@_prim("gated_paged_attention", fused.gated_paged_attention)
def _gated_paged_attention(q, gate, block_table, pos, *cache, page_size, scale):
    B, T, hq, d = _paged_attention(q, block_table, pos, *cache, page_size=page_size, scale=scale)[0].shape
    _check(gate.shape == (B * T, hq * d), lambda: f"gated_paged_attention: gate {gate} for {q}")
    return [gate]


@_prim("all_reduce", collective.all_reduce)
def _all_reduce(x, *, tp):
    _check(tp > 1, lambda: f"all_reduce over {tp} rank(s)")
    return [x]


@_prim("all_gather", collective.all_gather)
def _all_gather(x, *, tp):
    _check(tp > 1, lambda: f"all_gather over {tp} rank(s)")
    return [AVal((*x.shape[:-1], x.shape[-1] * tp), x.dtype)]


PRIMS.update({name: Primitive(name, rule, reference) for name, (rule, reference) in prims_vision.RULES.items()})
