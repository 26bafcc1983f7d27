"""gdn_conv: GDN depthwise causal conv + SiLU for decode/verify, and the conv half of the ReplaySSM fold.

History per slot is [width-1, C] bf16, oldest column first (the last pre-conv columns). Slot ids come
from a device buffer; a negative slot marks a padded row that the kernel skips. `commit_record` folds
the previous round's columns (prev_rec, a different arena from rec) and then verifies this round.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param, ceil_div

MODES = ("update", "record", "fold", "commit_record")


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "gdn_conv"
    c: int                 # channels (conv_dim = 2·Hk·Dk + Hv·Dv)
    b: int                 # rows
    t: int                 # tokens per row
    width: int
    mode: str
    arch: str

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"gdn_conv: mode {self.mode!r} not in {MODES}")

    def _name_parts(self):
        return [self.mode, f"c{self.c}", f"b{self.b}", f"t{self.t}"]


TSEG = 32       # tokens per block in 'update' mode (prefill): segments run in parallel


def segments(key: Key) -> int:
    return ceil_div(key.t, TSEG) if key.mode == "update" else 1


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((ceil_div(key.c, 128), key.b, segments(key)), (128, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("y", "ptr", "conv+SiLU out [b, t, c] bf16 (not fold)"),
            Param("x", "ptr", "pre-conv projection [b, t, c] bf16 (not fold)"),
            Param("w", "ptr", "conv weight [c, width] bf16 (not fold)"),
            Param("hist", "ptr", "history [slots, width-1, c] bf16"),
            Param("slots", "ptr", "[b] int32 slot per row, < 0 = padded row"),
            Param("rec", "ptr", "record columns [b, t, c] bf16 (record: written; fold: read)"),
            Param("commit", "ptr", "[b] int32 commit length m (fold, commit_record)"),
            Param("prev_rec", "ptr", "previous round's record columns [b, t, c] bf16 (commit_record)")]


def reference(key: Key, hist: torch.Tensor, slots: torch.Tensor, x=None, w=None, rec=None, commit=None,
              prev_rec=None):
    """Returns (y or None, new history). Rows with slot < 0 are left untouched (y rows zero)."""
    if key.mode == "commit_record":     # fold the previous round, then verify this one
        _, hist = reference(replace(key, mode="fold"), hist, slots, rec=prev_rec, commit=commit)
        return reference(replace(key, mode="record"), hist, slots, x, w)
    hist = hist.clone()
    hw = key.width - 1
    y = None if key.mode == "fold" else torch.zeros(key.b, key.t, key.c, dtype=torch.bfloat16)
    for r in range(key.b):
        s = int(slots[r])
        if s < 0:
            continue
        if key.mode == "fold":
            m = min(int(commit[r]), key.t)
            if m > 0:
                hist[s] = torch.cat([hist[s], rec[r, :m]])[-hw:]
            continue
        seq = torch.cat([hist[s], x[r]]).float()                         # [hw + t, c]
        win = seq.unfold(0, key.width, 1)                                 # [t, c, width]
        y[r] = torch.nn.functional.silu((win * w.float()).sum(-1)).to(torch.bfloat16)
        if key.mode == "update":
            hist[s] = torch.cat([hist[s], x[r]])[-hw:]
    return y, hist
