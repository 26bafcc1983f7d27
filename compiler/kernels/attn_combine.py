"""attn_combine: reduces attn_decode split partials (m, l, unnormalised o) and applies the gate.

Its key mirrors the attn_decode key it follows (same splits and page): make it with `for_decode`, which also picks
`groups`, the split groups a block's threads reduce side by side (templates/attn_combine.cu.j2).
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
    groups: int = 1      # split groups per block (D threads each), reduced side by side, then added in group order

    def __post_init__(self):
        if not 1 <= self.groups <= self.splits or self.d * self.groups > 1024:
            raise ValueError(f"attn_combine: {self.groups} groups of {self.d} threads over {self.splits} splits "
                             "(1 ≤ groups ≤ splits, d · groups ≤ 1024 threads)")

    def _name_parts(self):
        return [f"q{self.hq}", f"d{self.d}", f"b{self.b}", f"t{self.t}", f"p{self.page}", f"s{self.splits}"] + \
            (["gate"] if self.gate else []) + ([f"g{self.groups}"] if self.groups > 1 else [])


def split_groups(d: int, splits: int) -> int:
    """Groups of ≥ 8 splits each, up to 4 and 1,024 threads: at 66 splits (the 27B's long-context profiles) 4
    groups of ≤ 17, which a thread loads in three batches instead of walking 66 splits twice."""
    return max(1, min(4, 1024 // d, splits // 8))


def for_decode(dk) -> Key:
    return Key(dk.hq, dk.d, dk.b, dk.t, dk.page, dk.splits, dk.gate, dk.arch, split_groups(dk.d, dk.splits))


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((key.hq, key.b * key.t, 1), (key.d * key.groups, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("out", "ptr", "[b, t, hq, d] bf16"), Param("part_o", "ptr", "from attn_decode"),
            Param("part_ml", "ptr", "from attn_decode"), Param("gate_src", "ptr", "[b·t, hq, 2d] bf16"),
            Param("seq_lens", "ptr", "[b] int32")]
