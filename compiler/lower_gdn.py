"""lower_gdn: the lowering rules of the Gated DeltaNet layers' primitives — the conv (update, record, fold and
fold-then-record: gdn_conv), the gates + recurrence (step, record, snapshot, fold, restore and fold-then-record:
gdn_step; a one-sequence prefill chunk of ≥ 64 tokens takes the chunked kernel, gdn_chunk). ReplaySSM's record
buffers are bound by the graph's own names for them, so either record set (rec, rec1) lowers the same way.
"""
from __future__ import annotations

from .kernels import KernelKey, gdn_chunk, gdn_conv, gdn_step
from .lower_ctx import Lowered, Val
from .plan import NULL, Binding, Input, State
from .targets import Target


def _gdn_conv(ctx, e):
    """gdn_conv (writes the history), gdn_conv_record (a verify: history read, columns logged) or
    gdn_conv_commit_record (the previous round's columns folded first, from the other record set)."""
    x, w, history, _, *rec = e.inputs
    mode = "commit_record" if e.prim == "gdn_conv_commit_record" else "record" if rec else "update"
    key = gdn_conv.Key(x.shape[2], ctx.b, ctx.t, w.shape[2], mode, ctx.target.arch)
    folds = mode == "commit_record"
    return Lowered([(key, {"y": Val(e.outputs[0]), "x": Val(x), "w": Val(w), "hist": ctx.state(history),
                           "slots": Input("slots"), "rec": ctx.state(rec[0]) if rec else NULL,
                           "commit": Input("commit") if folds else NULL,
                           "prev_rec": ctx.state(rec[1]) if folds else NULL})])


def _gdn_conv_fold(ctx, e):
    history, _, rec, _ = e.inputs
    key = gdn_conv.Key(rec.shape[2], rec.shape[0], rec.shape[1], history.shape[2] + 1, "fold", ctx.target.arch)
    return Lowered([(key, {"y": NULL, "x": NULL, "w": NULL, "hist": ctx.state(history), "slots": Input("slots"),
                           "rec": ctx.state(rec), "commit": Input("commit"), "prev_rec": NULL})])


def prefill_gdn_key(hk, hv, dk, dv, t: int, target: Target) -> KernelKey:
    """The GDN recurrence of a one-sequence prefill chunk: chunked (WY) from 64 tokens, else sequential."""
    if t >= 64 and t % 16 == 0:
        return gdn_chunk.make_key(hk, hv, dk, dv, t, target)
    return gdn_step.make_key(hk, hv, dk, dv, 1, t, "step", target)


RECORD_PARAMS = ("rec_k", "rec_v", "rec_g")      # gdn_step's record parameters: the layer's k, v, g records
FOLD_PARAMS = ("commit", "prev_k", "prev_v", "prev_g")
SNAPSHOT_PRIMS = ("gdn_step_snapshot",)


def _records(ctx, names: tuple[str, ...], records) -> dict[str, Binding]:
    """The record parameters bound to the graph's record values (the set the graph names: rec or rec1)."""
    return {p: ctx.state(v) for p, v in zip(names, records)}


def _gdn_step(ctx, e):
    """gdn_step, gdn_step_record (a verify: the committed state read, k, v, g and beta logged) or
    gdn_step_commit_record (the previous round's records, the other set, folded first; their count per row is
    the `commit` input). Prefill chunks of one sequence take the chunked kernel from 64 tokens."""
    q, _, v, a, b, a_log, dt_bias, state, _, *rec = e.inputs
    hk, dk, hv, dv = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    snapshots = e.prim in SNAPSHOT_PRIMS
    folds = e.prim == "gdn_step_commit_record"
    if ctx.graph.params["entry"] == "prefill" and ctx.b == 1:
        key = prefill_gdn_key(hk, hv, dk, dv, ctx.t, ctx.target)
    else:
        mode = "snapshot" if snapshots else "commit_record" if folds else "record" if rec else "step"
        key = gdn_step.make_key(hk, hv, dk, dv, ctx.b, ctx.t, mode, ctx.target)
    layer = ctx.layer(state)
    args = {"o": Val(e.outputs[0]), "qkv": Val(q), "a": Val(a), "b": Val(b), "a_log": Val(a_log),
            "dt_bias": Val(dt_bias), "state": ctx.state(state), "slots": Input("slots")}
    if key.family == "gdn_step":
        args |= (_records(ctx, RECORD_PARAMS, rec[:3]) if rec and not snapshots else dict.fromkeys(RECORD_PARAMS, NULL))
        args |= ({"commit": Input("commit")} | _records(ctx, FOLD_PARAMS[1:], rec[3:6])) if folds else \
            dict.fromkeys(FOLD_PARAMS, NULL)
        args |= {"snap": State(f"snap.{layer}") if snapshots else NULL}
    return Lowered([(key, args)], out_dtype="f32")


def _gdn_fold(ctx, e):
    """The ReplaySSM fold: the first commit[r] logged tokens of row r into its state (the step's key fields,
    so the same update runs: fold == that many steps, bit for bit)."""
    state, _, rec_k, rec_v, rec_g, _ = e.inputs
    b, t, hk, dk = rec_k.shape
    key = gdn_step.make_key(hk, rec_v.shape[2], dk, rec_v.shape[3], b, t, "fold", ctx.target)
    args = dict.fromkeys(("o", "qkv", "a", "b", "a_log", "dt_bias", "prev_k", "prev_v", "prev_g", "snap"), NULL)
    return Lowered([(key, args | {"state": ctx.state(state), "slots": Input("slots"), "commit": Input("commit")}
                     | _records(ctx, RECORD_PARAMS, (rec_k, rec_v, rec_g)))])


def _gdn_snapshot_restore(ctx, e):
    """Snapshot mode's commit: the state after the m-th verified token becomes the committed state."""
    state, _, snaps, _ = e.inputs
    b, t, hv, dk, dv = snaps.shape
    hk = ctx.spec.model.linear_attention.num_key_heads
    key = gdn_step.make_key(hk, hv, dk, dv, b, t, "restore", ctx.target)
    layer = ctx.layer(state)
    args = dict.fromkeys(("o", "qkv", "a", "b", "a_log", "dt_bias", "prev_k", "prev_v", "prev_g", *RECORD_PARAMS), NULL)
    return Lowered([(key, args | {"state": State(f"gdn.{layer}.state"), "slots": Input("slots"),
                                  "commit": Input("commit"), "snap": State(f"snap.{layer}")})])


GDN_RULES = {"gdn_conv": _gdn_conv, "gdn_step": _gdn_step, "gdn_conv_record": _gdn_conv, "gdn_step_record": _gdn_step,
             "gdn_conv_fold": _gdn_conv_fold, "gdn_fold": _gdn_fold, "gdn_step_snapshot": _gdn_step,
             "gdn_snapshot_restore": _gdn_snapshot_restore, "gdn_conv_commit_record": _gdn_conv,
             "gdn_step_commit_record": _gdn_step}
