"""reference_replayssm: torch references of the ReplaySSM primitives (REPLAYSSM.md) — the record-mode
GDN conv and recurrence of a verify step, which read the committed state and never write it but log
their per-token inputs per batch row, and the folds that replay the first m logged tokens of each row
into the state. A fold runs the same operations as m one-token steps, in the same order, so its state
is bit-identical to theirs.

Records per row r and token t: the pre-conv projection column (conv), raw k before l2 normalisation,
v, and (g, beta) as the verify step computed them, fp32.
"""
from __future__ import annotations

from ._torch import torch
from .reference_ops import _gdn_recurrent, _l2norm, _valid, gdn_conv_output, gdn_gates


def gdn_conv_record(c, w, history, slots, rec):
    """The verify step's conv over [history ++ c]; history untouched; rec[r] = c[r] for valid rows."""
    hist = history[slots.long().clamp(min=0)].to(c.dtype)
    out, _ = gdn_conv_output(c, w, hist)
    rows = _valid(slots)
    rec[rows] = c[rows].to(rec.dtype)
    return out


def gdn_conv_fold(history, slots, rec, commit):
    """history[slot] ← the last K−1 columns of (history ++ rec[r, :m]), m = min(commit[r], T); m = 0 no-op."""
    width = history.shape[-1]
    for r in _valid(slots).tolist():
        m = min(int(commit[r]), rec.shape[1])
        if m > 0:
            s = int(slots[r])
            full = torch.cat((history[s], rec[r, :m].transpose(0, 1).to(history.dtype)), dim=-1)
            history[s] = full[:, -width:]


def gdn_recurrence_record(q, k, v, g, beta, state, slots, rec_k, rec_v, rec_g):
    """The verify step's recurrence from the committed state, which stays untouched; logs raw k, v and
    (g, beta) of the valid rows."""
    B, T, hk, dk = q.shape
    grp = v.shape[2] // hk
    qf = (_l2norm(q.float()) / dk ** 0.5).repeat_interleave(grp, dim=2).transpose(1, 2)
    kf = _l2norm(k.float()).repeat_interleave(grp, dim=2).transpose(1, 2)
    vf, gf, bf = v.float().transpose(1, 2), g.float().transpose(1, 2), beta.float().transpose(1, 2)
    out, _ = _gdn_recurrent(qf, kf, vf, gf, bf, state[slots.long().clamp(min=0)])
    rows = _valid(slots)
    rec_k[rows], rec_v[rows] = k[rows].to(rec_k.dtype), v[rows].to(rec_v.dtype)
    rec_g[rows] = torch.stack((g.float(), beta.float()), dim=-1)[rows]
    return out.transpose(1, 2).to(v.dtype)


def gdn_step_record(q, k, v, a, b, a_log, dt_bias, state, slots, rec_k, rec_v, rec_g):
    """gdn_gates → gdn_recurrence_record (passes.fuse_gdn_gates)."""
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    shape = v.shape[:3]
    return gdn_recurrence_record(q, k, v, g.reshape(shape), beta.reshape(shape), state, slots, rec_k, rec_v, rec_g)


def gdn_fold(state, slots, rec_k, rec_v, rec_g, commit):
    """state[slot] ← the recurrence over the first m logged tokens of row r (m = min(commit[r], T))."""
    hk = rec_k.shape[2]
    grp = rec_v.shape[2] // hk
    for r in _valid(slots).tolist():
        m = min(int(commit[r]), rec_k.shape[1])
        if m <= 0:
            continue
        s = int(slots[r])
        kf = _l2norm(rec_k[r:r + 1, :m].float()).repeat_interleave(grp, dim=2).transpose(1, 2)
        vf = rec_v[r:r + 1, :m].float().transpose(1, 2)
        gb = rec_g[r:r + 1, :m].transpose(1, 2)
        _, s1 = _gdn_recurrent(torch.zeros_like(kf), kf, vf, gb[..., 0], gb[..., 1], state[s:s + 1])
        state[s] = s1[0]
