"""gdn_step: Gated DeltaNet gates + recurrence (decode/verify), ReplaySSM record mode and fold.

State fp32 [slots, Hv, Dk, Dv]; value head h uses key head h // (Hv/Hk). Records per row and token:
raw k (before l2norm) [Hk, Dk] bf16, v [Hv, Dv] bf16, (g, beta) [Hv, 2] fp32 (REPLAYSSM.md).
`dv_split` blocks share one head's columns; the fold must use the same key fields as the step.
Mode `commit_record` folds the previous round's records (prev_*) and verifies this round in one pass:
prev_* and rec_* must be different arenas (ping-pong per round), since blocks write this round's
records while other blocks still read the previous round's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param

MODES = ("step", "record", "fold", "commit_record", "snapshot", "restore")


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "gdn_step"
    hk: int
    hv: int
    dk: int
    dv: int
    b: int
    t: int
    mode: str
    dv_split: int          # blocks per value head (columns split), from the target's SM count
    arch: str

    def __post_init__(self):
        if self.mode not in MODES or self.dk % 32 or self.hv % self.hk or self.dv % self.dv_split:
            raise ValueError(f"gdn_step: bad key {self}")
        if (4 * self.dv // self.dv_split) % 32 or 4 * self.dv // self.dv_split < 64:
            raise ValueError(f"gdn_step: dv/dv_split must give ≥ 2 whole warps (≥ 8 tokens per window): {self}")

    def _name_parts(self):
        return [self.mode, f"hk{self.hk}", f"hv{self.hv}", f"dk{self.dk}", f"dv{self.dv}", f"b{self.b}",
                f"t{self.t}", f"s{self.dv_split}"]


def make_key(hk, hv, dk, dv, b, t, mode, target: Target) -> Key:
    """Split columns until the grid covers the SMs (never below 32 columns per block)."""
    split = 1
    while hv * b * split < target.sms and dv // (split * 2) >= 32 and dv % (split * 2) == 0:
        split *= 2
    return Key(hk, hv, dk, dv, b, t, mode, split, target.arch)


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((key.hv, key.b, key.dv_split), (4 * key.dv // key.dv_split, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("o", "ptr", "out [b, t, hv, dv] f32 (not fold)"),
            Param("qkv", "ptr", "conv output [b, t, 2·hk·dk + hv·dv] bf16 (not fold)"),
            Param("a", "ptr", "[b, t, hv] f32"), Param("b", "ptr", "[b, t, hv] f32"),
            Param("a_log", "ptr", "[hv] f32"), Param("dt_bias", "ptr", "[hv] f32"),
            Param("state", "ptr", "[slots, hv, dk, dv] f32"), Param("slots", "ptr", "[b] int32, < 0 = skip"),
            Param("rec_k", "ptr", "[b, t, hk, dk] bf16"), Param("rec_v", "ptr", "[b, t, hv, dv] bf16"),
            Param("rec_g", "ptr", "[b, t, hv, 2] f32 (g, beta)"),
            Param("commit", "ptr", "[b] int32 m (fold, commit_record)"),
            Param("prev_k", "ptr", "previous round's rec_k (commit_record)"), Param("prev_v", "ptr", ""),
            Param("prev_g", "ptr", ""),
            Param("snap", "ptr", "[b, t, hv, dk, dv] f32 state after each token (snapshot: written; restore: read)")]


def gates(a, b, a_log, dt_bias):
    g = -torch.exp(a_log.float()) * torch.nn.functional.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def _l2n(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _run(key: Key, S, k, v, g, beta, q=None):
    """S [hv, dk, dv] fp32; k [t, hk, dk] raw; v [t, hv, dv]; g, beta [t, hv]. Returns (S, o or None)."""
    grp = key.hv // key.hk
    kn = _l2n(k.float()).repeat_interleave(grp, dim=1)                     # [t, hv, dk]
    qn = None if q is None else (_l2n(q.float()) / key.dk ** 0.5).repeat_interleave(grp, dim=1)
    outs = []
    for tt in range(k.shape[0]):
        S = S * torch.exp(g[tt]).view(-1, 1, 1)
        u = torch.einsum("hij,hi->hj", S, kn[tt])
        S = S + kn[tt].unsqueeze(-1) * (beta[tt].view(-1, 1) * (v[tt].float() - u)).unsqueeze(1)
        if qn is not None:
            outs.append(torch.einsum("hij,hi->hj", S, qn[tt]))
    return S, (torch.stack(outs) if outs else None)


def reference(key: Key, state, slots, qkv=None, a=None, b=None, a_log=None, dt_bias=None,
              rec=None, commit=None, prev=None):
    """Returns (o [b, t, hv, dv] f32 or None, new state, records dict or None)."""
    if key.mode == "commit_record":     # fold the previous round's records, then verify this round
        _, state, _ = reference(replace(key, mode="fold"), state, slots, rec=prev, commit=commit)
        return reference(replace(key, mode="record"), state, slots, qkv, a, b, a_log, dt_bias)
    state = state.clone()
    hkd = key.hk * key.dk
    o = None if key.mode == "fold" else torch.zeros(key.b, key.t, key.hv, key.dv)
    out_rec = {"k": torch.zeros(key.b, key.t, key.hk, key.dk, dtype=torch.bfloat16),
               "v": torch.zeros(key.b, key.t, key.hv, key.dv, dtype=torch.bfloat16),
               "g": torch.zeros(key.b, key.t, key.hv, 2)}
    for r in range(key.b):
        s = int(slots[r])
        if s < 0:
            continue
        if key.mode == "fold":
            m = min(int(commit[r]), key.t)
            if m > 0:
                gb = rec["g"][r, :m]
                state[s], _ = _run(key, state[s], rec["k"][r, :m], rec["v"][r, :m], gb[..., 0], gb[..., 1])
            continue
        q = qkv[r, :, :hkd].view(key.t, key.hk, key.dk)
        k = qkv[r, :, hkd:2 * hkd].view(key.t, key.hk, key.dk)
        v = qkv[r, :, 2 * hkd:].view(key.t, key.hv, key.dv)
        g, beta = gates(a[r], b[r], a_log, dt_bias)
        new, o[r] = _run(key, state[s], k, v, g, beta, q)
        if key.mode == "step":
            state[s] = new
        out_rec["k"][r], out_rec["v"][r], out_rec["g"][r] = k, v, torch.stack([g, beta], -1)
    return o, state, (out_rec if key.mode == "record" else None)
