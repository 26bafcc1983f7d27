"""reference_replayssm: torch references of the ReplaySSM primitives (REPLAYSSM.md) — the record-mode
GDN conv and recurrence of a verify step, which read the committed state and never write it but log
their per-token inputs per batch row, and the folds that replay the first m logged tokens of each row
into the state. A fold runs the same operations as m one-token steps, in the same order, so its state
is bit-identical to theirs.

Records per row r and token t: the pre-conv projection column (conv), raw k before l2 normalisation,
v, and (g, beta) as the verify step computed them, fp32.

Snapshot mode (the common design, for comparison): the verify's recurrence writes the state after each
of its T tokens into K+1 snapshot copies per row, and the commit copies snapshot m−1 into the state; the
conv history still takes the logged columns (its snapshots would be 3 columns each).
"""
from __future__ import annotations

from ._torch import torch
from .reference_ops import gdn_conv_output, gdn_gates, gdn_sequential, l2norm, read_slots, valid_rows


def bind_torch() -> None:
    """As reference_ops.bind_torch: the real torch module from here on."""
    global torch
    import torch as real
    torch = real


def _folds(slots, commit, tokens: int):
    """(row, slot, m) of the valid rows with m = min(commit[r], tokens) > 0 tokens to fold."""
    counts = commit.tolist()
    for r, s in enumerate(slots.tolist()):
        m = min(counts[r], tokens)
        if s >= 0 and m > 0:
            yield r, s, m


def _log(rec, rows: list[int], value) -> None:
    """rec[r] ← value[r] for the valid rows r (one copy when every row is valid)."""
    if len(rows) == rec.shape[0]:
        rec.copy_(value)
    else:
        for r in rows:
            rec[r].copy_(value[r])


def gdn_conv_record(c, w, history, slots, rec):
    """The verify step's conv over [history ++ c]; history untouched; rec[r] = c[r] for valid rows."""
    hist = read_slots(history, slots).to(c.dtype)
    out, _ = gdn_conv_output(c, w, hist)
    _log(rec, valid_rows(slots), c)
    return out


def gdn_conv_fold(history, slots, rec, commit):
    """history[slot] ← the last K−1 columns of (history ++ rec[r, :m]), m = min(commit[r], T); m = 0 no-op."""
    width = history.shape[-1]
    for r, s, m in _folds(slots, commit, rec.shape[1]):
        full = torch.cat((history[s], rec[r, :m].transpose(0, 1).to(history.dtype)), dim=-1)
        history[s] = full[:, -width:]


def gdn_recurrence_record(q, k, v, g, beta, state, slots, rec_k, rec_v, rec_g):
    """The verify step's recurrence from the committed state, which stays untouched; logs raw k, v and
    (g, beta) of the valid rows."""
    B, T, hk, dk = q.shape
    grp = v.shape[2] // hk
    qf = (l2norm(q.float()) / dk ** 0.5).repeat_interleave(grp, dim=2).transpose(1, 2)
    kf = l2norm(k.float()).repeat_interleave(grp, dim=2).transpose(1, 2)
    vf, gf, bf = v.float().transpose(1, 2), g.float().transpose(1, 2), beta.float().transpose(1, 2)
    out, _ = gdn_sequential(qf, kf, vf, gf, bf, read_slots(state, slots))
    rows = valid_rows(slots)
    _log(rec_k, rows, k)
    _log(rec_v, rows, v)
    _log(rec_g, rows, torch.stack((g.float(), beta.float()), dim=-1))
    return out.transpose(1, 2).to(v.dtype)


def gdn_step_record(q, k, v, a, b, a_log, dt_bias, state, slots, rec_k, rec_v, rec_g):
    """gdn_gates → gdn_recurrence_record (passes.fuse_gdn_gates)."""
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    shape = v.shape[:3]
    return gdn_recurrence_record(q, k, v, g.reshape(shape), beta.reshape(shape), state, slots, rec_k, rec_v, rec_g)


def gdn_conv_commit_record(c, w, history, slots, rec, prev_rec, commit):
    """The previous round's first m columns folded into the history (gdn_conv_fold), then this verify's conv
    (gdn_conv_record): passes.fuse_fold_into_verify."""
    gdn_conv_fold(history, slots, prev_rec, commit)
    return gdn_conv_record(c, w, history, slots, rec)


def gdn_step_commit_record(q, k, v, a, b, a_log, dt_bias, state, slots, rec_k, rec_v, rec_g, prev_k, prev_v, prev_g,
                           commit):
    """The previous round's first m records folded into the state (gdn_fold), then this verify's recurrence
    (gdn_step_record): passes.fuse_fold_into_verify."""
    gdn_fold(state, slots, prev_k, prev_v, prev_g, commit)
    return gdn_step_record(q, k, v, a, b, a_log, dt_bias, state, slots, rec_k, rec_v, rec_g)


def gdn_fold(state, slots, rec_k, rec_v, rec_g, commit):
    """state[slot] ← the recurrence over the first m logged tokens of row r (m = min(commit[r], T))."""
    hk = rec_k.shape[2]
    grp = rec_v.shape[2] // hk
    for r, s, m in _folds(slots, commit, rec_k.shape[1]):
        kf = l2norm(rec_k[r:r + 1, :m].float()).repeat_interleave(grp, dim=2).transpose(1, 2)
        vf = rec_v[r:r + 1, :m].float().transpose(1, 2)
        gb = rec_g[r:r + 1, :m].transpose(1, 2)
        _, s1 = gdn_sequential(None, kf, vf, gb[..., 0], gb[..., 1], state[s:s + 1])
        state[s] = s1[0]


def gdn_recurrence_snapshot(q, k, v, g, beta, state, slots, snaps):
    """The verify step's recurrence from the committed state, which stays untouched; snaps[r, t] ← the
    state after token t of each valid row (snaps [B, T, Hv, Dk, Dv] fp32)."""
    B, T, hk, dk = q.shape
    grp = v.shape[2] // hk
    qf = (l2norm(q.float()) / dk ** 0.5).repeat_interleave(grp, dim=2).transpose(1, 2)
    kf = l2norm(k.float()).repeat_interleave(grp, dim=2).transpose(1, 2)
    vf, gf, bf = v.float().transpose(1, 2), g.float().transpose(1, 2), beta.float().transpose(1, 2)
    s = read_slots(state, slots)
    outs = []
    for t in range(T):
        o, s = gdn_sequential(qf[:, :, t:t + 1], kf[:, :, t:t + 1], vf[:, :, t:t + 1], gf[:, :, t:t + 1],
                              bf[:, :, t:t + 1], s)
        outs.append(o)
        for r in valid_rows(slots):
            snaps[r, t] = s[r]
    return torch.cat(outs, dim=2).transpose(1, 2).to(v.dtype)


def gdn_step_snapshot(q, k, v, a, b, a_log, dt_bias, state, slots, snaps):
    """gdn_gates → gdn_recurrence_snapshot (passes.fuse_gdn_gates)."""
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    shape = v.shape[:3]
    return gdn_recurrence_snapshot(q, k, v, g.reshape(shape), beta.reshape(shape), state, slots, snaps)


def gdn_snapshot_restore(state, slots, snaps, commit):
    """state[slot] ← snaps[r, m − 1] (m = min(commit[r], T)); m = 0: nothing."""
    for r, s, m in _folds(slots, commit, snaps.shape[1]):
        state[s] = snaps[r, m - 1]
