"""argmax: greedy token choice over fp32 logits [M, V]; ties go to the lowest index.

Needs a workspace of M·slices float2 and M uint32 counters that start at zero; the kernel leaves
them at zero again, so one allocation serves every replay.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param, ceil_div

CHUNK = 8192    # must match templates/argmax.cu.j2


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "argmax"
    v: int
    m: int
    arch: str

    def _name_parts(self):
        return [f"v{self.v}", f"m{self.m}"]


def slices(key: Key) -> int:
    return ceil_div(key.v, CHUNK)


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((slices(key), key.m, 1), (256, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("out", "ptr", "[m] int32 token ids"), Param("logits", "ptr", "[m, v] f32"),
            Param("partial", "ptr", "workspace [m, slices] float2"),
            Param("counters", "ptr", "[m] uint32, zero before the first launch (left zero)")]


def reference(key: Key, logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits.float(), dim=-1).to(torch.int32)    # first maximal index
