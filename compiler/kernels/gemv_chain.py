"""gemv_chain: several decode GEMVs (gemv keys of our weight formats) in one launch — fewer kernel boundaries
per forward (issue 32 item 2; compiler/chains.py decides which calls join).

A chain is a tuple of stages, each a tuple of gemv keys that may run at once (a layer's input projections).
Every member runs its own template (templates/gemv.cu.j2 rendered as a `Block` in its own namespace) with its
own reduction order, so each member writes the bits its own launch would. The chain's block has the widest
member's warps; a narrower member runs `threads / (32·warps)` of its blocks side by side in one chain block
(virtual blocks, each with its own named barrier and shared memory).

One stage (a group): block i runs item i; each member waits for the previous kernel itself (`pdl_entry`).
Several stages: the chain waits for the previous kernel once, then every block takes the next item from a
ticket counter, so items start in stage order; a later stage's block loads its first weights, then spins until
every block of the stage before has finished (a done counter per stage), and reads what earlier stages wrote
through L2 (`coherent`: no non-coherent or L1 hits on data written inside the launch). Waiting only for items
that hold smaller tickets, which were taken by running blocks, cannot deadlock. The last block to finish zeroes
the counters for the next launch or graph replay.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import ClassVar

from . import KernelKey, Launch, Param, ceil_div
from . import gemv

MAX_MEMBERS = 16


def blocks_of(key: gemv.Key) -> int:
    """The member's grid (gemv.launch)."""
    return gemv.launch(key).grid[0]


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "gemv_chain"
    member_templates: ClassVar[tuple[str, ...]] = ("gemv.cu.j2",)
    stages: tuple[tuple[gemv.Key, ...], ...]
    arch: str

    def __post_init__(self):
        members = [m for s in self.stages for m in s]
        if not self.stages or any(not s for s in self.stages) or not 2 <= len(members) <= MAX_MEMBERS:
            raise ValueError(f"gemv_chain: needs 2..{MAX_MEMBERS} members in non-empty stages, got "
                             f"{[len(s) for s in self.stages]}")
        for m in members:
            if not isinstance(m, gemv.Key) or m.template is not None:
                raise ValueError(f"gemv_chain: members are gemv keys of our weight formats, got {m}")
            if m.arch != self.arch:
                raise ValueError(f"gemv_chain: member arch {m.arch} differs from the chain's {self.arch}")
        if self.threads % 32 or any(self.threads % (32 * m.warps) for m in members):
            raise ValueError(f"gemv_chain: member warps {[m.warps for m in members]} do not divide the block")

    @property
    def members(self) -> list[gemv.Key]:
        return [m for s in self.stages for m in s]

    @property
    def chained(self) -> bool:
        return len(self.stages) > 1

    @property
    def threads(self) -> int:
        return 32 * max(m.warps for m in self.members)

    def items(self, m: gemv.Key) -> int:
        """Chain blocks the member takes: its blocks, `threads / (32·warps)` to a chain block."""
        return ceil_div(blocks_of(m), self.threads // (32 * m.warps))

    def fields(self) -> dict:
        """The template's variables (JSON): per member its own key's fields, its blocks and parameter names."""
        return {"arch": self.arch, "stages": [[{"key": m.fields(), "name": m.name, "blocks": blocks_of(m),
                                               "params": [p.name for p in gemv.params(m)]} for m in s]
                                             for s in self.stages]}

    def _name_parts(self):
        digest = hashlib.sha256("|".join(";".join(m.name for m in s) for s in self.stages).encode()).hexdigest()
        return [f"s{len(self.stages)}", f"m{len(self.members)}", digest[:12]]


def launch(key: Key, target=None) -> Launch:
    return Launch((sum(key.items(m) for m in key.members), 1, 1), (key.threads, 1, 1), 0)


def member_param(i: int, name: str) -> str:
    """A member's parameter in the chain's parameter list: `m<i>.<name>`."""
    return f"m{i}.{name}"


def params(key: Key) -> list[Param]:
    out = [Param("counters", "ptr", "u32 [stages + 2]: ticket, done per stage, finished; zero before the first "
                 "launch, left zero (compiler/chains.py binds them)")] if key.chained else []
    for i, m in enumerate(key.members):
        out += [Param(member_param(i, p.name), p.kind, p.doc) for p in gemv.params(m)]
    return out

