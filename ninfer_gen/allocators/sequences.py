"""sequences: what every backend does to a sequence's resources — a GDN state slot and a KV block
table — allocating, growing within the context limit (a short pool first takes back the pages of cached
prefix checkpoints: `prefix`, an allocators.prefix.PrefixCache), and releasing. Pure Python (no CUDA);
the backend says how a slot's state is cleared (`_reset_slot`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ninfer_gen.allocators.kv import BlockManager, BlockTable
from ninfer_gen.allocators.slots import SlotAllocator


@dataclass
class Sequence:
    """One sequence's resources: its GDN state slot and its KV block table (pages, tokens held)."""
    slot: int
    table: BlockTable = field(default_factory=BlockTable)
    positions: Any = None      # a prompt with images: its RoPE positions (compiler.multimodal.RopePositions);
                               # None: a token's RoPE position is its cache position

    @property
    def length(self) -> int:
        return self.table.length


class SequencePool:
    def __init__(self, num_slots: int, num_pages: int, page_size: int, max_context: int):
        self.slots = SlotAllocator(num_slots)
        self.blocks = BlockManager(num_pages, page_size)
        self.max_context = max_context
        self._verified: dict[int, int] = {}          # slot → tokens its last verify logged (speculative rounds)
        self.prefix = None                           # the pool's PrefixCache, if one was made (PrefixCache.on)

    def _reset_slot(self, slot: int) -> None:
        raise NotImplementedError

    def new_sequence(self) -> Sequence:
        slot = self.slots.allocate()
        self._reset_slot(slot)
        return Sequence(slot)

    def release(self, seq: Sequence) -> None:
        self._verified.pop(seq.slot, None)           # a round left unfinished: its records die with the slot
        self.slots.free(seq.slot)
        self.blocks.free(seq.table)

    def usage(self) -> dict[str, int]:
        """Slots and pages in use (and the prefix cache's checkpoints, if it has one)."""
        slots, blocks = self.slots, self.blocks
        return {"slots": slots.num_slots, "slots_in_use": slots.num_slots - slots.free_slots,
                "pages": blocks.num_pages, "pages_in_use": blocks.num_pages - blocks.free_pages,
                **(self.prefix.usage() if self.prefix is not None else {})}

    def reserve(self, seq: Sequence, length: int) -> None:
        if length > self.max_context:
            raise ValueError(f"sequence of {length} tokens exceeds the context limit {self.max_context}")
        short = self.blocks.pages_for(length) - len(seq.table.pages) - self.blocks.free_pages
        if short > 0 and self.prefix is not None:    # live sequences come first: cached prefixes give way
            self.prefix.reclaim(short)
        self.blocks.reserve(seq.table, length)

    def _verified_tokens(self, seq: Sequence, tokens: int) -> None:
        """A verify of `tokens` positions logged records for the sequence (reserving their pages)."""
        self.reserve(seq, seq.length + tokens)
        self._verified[seq.slot] = tokens

    def _committing(self, seq: Sequence, m: int) -> int:
        """The tokens the sequence's last verify logged, which a commit of m must not exceed."""
        tokens = self._verified.pop(seq.slot, None)
        if tokens is None or not 0 <= m <= tokens:
            raise ValueError(f"commit of {m} tokens without a verify of at least that many (last: {tokens})")
        return tokens
