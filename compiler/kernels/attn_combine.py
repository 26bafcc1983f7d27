"""attn_combine: reduces attn_decode split partials (m, l, unnormalised o) and applies the gate.

Its key mirrors the attn_decode key it follows (same splits and page): make it with `for_decode`, which also picks
`groups`, the split groups a block's threads reduce side by side (templates/attn_combine.cu.j2), and `ds`, the dims a
block covers: a block of ds × groups threads (128 at the 27B's shape) so that, launched programmatically, its blocks
fit beside the attn_decode blocks still running (a 1,024-thread block wants a whole SM's registers) and wait there
instead of launching after the last one leaves. The same arithmetic per (row, dim): the same bits at any ds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..targets import Target
from . import KernelKey, Launch, Param


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "attn_combine"
    hq: int
    d: int
    b: int
    t: int
    page: int
    splits: int
    gate: bool
    arch: str
    groups: int = 1      # split groups per block (ds threads each), reduced side by side, then added in group order
    ds: int = 0          # dims a block covers (0: all d); d / ds blocks a row

    def __post_init__(self):
        ds = self.ds or self.d
        if not 1 <= self.groups <= self.splits or ds * self.groups > 1024:
            raise ValueError(f"attn_combine: {self.groups} groups of {ds} threads over {self.splits} splits "
                             "(1 ≤ groups ≤ splits, ds · groups ≤ 1024 threads)")
        if self.d % ds or ds % 32 or self.ds == self.d:
            raise ValueError(f"attn_combine: {ds} dims a block must divide d = {self.d} in whole warps "
                             "(0 for all of them: one key per kernel)")

    def _name_parts(self):
        return [f"q{self.hq}", f"d{self.d}", f"b{self.b}", f"t{self.t}", f"p{self.page}", f"s{self.splits}"] + \
            (["gate"] if self.gate else []) + ([f"g{self.groups}"] if self.groups > 1 else []) + \
            ([f"x{self.ds}"] if self.ds else [])


def split_groups(d: int, splits: int) -> int:
    """Groups of ≥ 8 splits each, up to 4 and 1,024 threads: at 66 splits (the 27B's long-context profiles) 4
    groups of ≤ 17, which a thread loads in three batches instead of walking 66 splits twice."""
    return max(1, min(4, 1024 // d, splits // 8))


BLOCK_THREADS = 128     # a combine block's threads at most (for_decode): room beside two attn_decode blocks an SM


def for_decode(dk) -> Key:
    groups = split_groups(dk.d, dk.splits)
    ds = max(32, BLOCK_THREADS // groups)
    return Key(dk.hq, dk.d, dk.b, dk.t, dk.page, dk.splits, dk.gate, dk.arch, groups, 0 if ds >= dk.d else ds)


def launch(key: Key, target: Target | None = None) -> Launch:
    ds = key.ds or key.d
    return Launch((key.hq, key.b * key.t, key.d // ds), (ds * key.groups, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("out", "ptr", "[b, t, hq, d] bf16"), Param("part_o", "ptr", "from attn_decode"),
            Param("part_ml", "ptr", "from attn_decode"), Param("gate_src", "ptr", "[b·t, hq, 2d] bf16"),
            Param("seq_lens", "ptr", "[b] int32")]
