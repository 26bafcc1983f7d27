"""attn_combine: reduces attn_decode split partials (m, l, unnormalised o) and applies the gate.

Its key mirrors the attn_decode key it follows (same splits and page): make it with `for_decode`.
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

    def _name_parts(self):
        return [f"q{self.hq}", f"d{self.d}", f"b{self.b}", f"t{self.t}", f"p{self.page}", f"s{self.splits}"] + \
            (["gate"] if self.gate else [])


def for_decode(dk) -> Key:
    return Key(dk.hq, dk.d, dk.b, dk.t, dk.page, dk.splits, dk.gate, dk.arch)


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((key.hq, key.b * key.t, 1), (key.d, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("out", "ptr", "[b, t, hq, d] bf16"), Param("part_o", "ptr", "from attn_decode"),
            Param("part_ml", "ptr", "from attn_decode"), Param("gate_src", "ptr", "[b·t, hq, 2d] bf16"),
            Param("seq_lens", "ptr", "[b] int32")]
