"""state: the GDN state-slot allocator — one slot (fp32 recurrent state + conv history) per live
lane, distinct slots always (ReplaySSM invariant 3). Pure Python; imports no CUDA."""
from __future__ import annotations


class OutOfSlots(RuntimeError):
    pass


class SlotAllocator:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"need at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlots(f"all {self.num_slots} state slots are in use (one per concurrent request)")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)
