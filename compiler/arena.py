"""arena: one activation arena per plan — first-fit offsets for every value an equation produces, reused
by liveness (a value lives from its producer to its last reader, through views; graph outputs to the
end). Views (reshape, slice) take their base value's bytes: a slice along the first axis moves the
offset, a slice along a later axis keeps the base's start (the kernels reading it know the layout).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .ir import Graph, Var

VIEWS = ("reshape", "slice")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i8": 1}
ALIGN = 256


@dataclass
class ArenaLayout:
    slots: dict[int, tuple[int, int]]        # base value uid → (offset, bytes)
    live: dict[int, tuple[int, int]]         # base value uid → (first, last) equation
    views: dict[int, tuple[int, int]]        # view uid → (base uid, byte offset into the base)
    dtypes: dict[int, str]                   # base value uid → the dtype its kernel writes, where wider
    nbytes: int

    def base(self, v: Var) -> tuple[int, int]:
        """(base uid, byte offset) of a value or view."""
        return self.views.get(v.uid, (v.uid, 0))

    def offset(self, v: Var) -> int | None:
        """The arena byte offset of v (through views), None when its base has no slot (inputs, weights, state)."""
        b, off = self.base(v)
        return self.slots[b][0] + off if b in self.slots else None

    def dtype(self, v: Var) -> str:
        return self.dtypes.get(self.base(v)[0], v.dtype)


def nbytes(v: Var, dtype: str | None = None) -> int:
    return -(-math.prod(v.shape) * DTYPE_BYTES[dtype or v.dtype] // ALIGN) * ALIGN


def allocate(g: Graph, dtypes: dict[int, str] | None = None, skip: set[int] = frozenset(),
             in_place: dict[int, int] | None = None) -> ArenaLayout:
    """First-fit offsets for every non-view value but those in `skip` (values that live elsewhere);
    `dtypes` overrides a value's dtype where its kernel writes a wider one than the graph says (fp32
    GEMV outputs, the GDN step's fp32 output); `in_place` maps an output to the input whose bytes its
    kernel overwrites with it (a view of that input's base from then on)."""
    dtypes, in_place = dtypes or {}, in_place or {}
    views: dict[int, tuple[int, int]] = {}
    start, end, size = {}, {}, {}
    for i, e in enumerate(g.eqns):
        for x in e.inputs:
            if isinstance(x, Var):
                end[views.get(x.uid, (x.uid, 0))[0]] = i
        for o in e.outputs:
            if e.prim in VIEWS:
                src = e.inputs[0]
                b, off = views.get(src.uid, (src.uid, 0))
                if e.prim == "slice" and e.params["axis"] == 0:
                    off += e.params["start"] * math.prod(src.shape[1:]) * DTYPE_BYTES[dtypes.get(b, src.dtype)]
                views[o.uid] = (b, off)
            elif o.uid in in_place:
                views[o.uid] = views.get(in_place[o.uid], (in_place[o.uid], 0))
            elif o.uid not in skip:
                start[o.uid], end[o.uid] = i, i
                size[o.uid] = nbytes(o, dtypes.get(o.uid))
    for v in g.outputs.values():
        end[views.get(v.uid, (v.uid, 0))[0]] = len(g.eqns)
    end = {u: i for u, i in end.items() if u in start}
    active: list[tuple[int, int, int]] = []   # (offset, bytes, end)
    slots, live, top = {}, {}, 0
    for uid in sorted(start, key=start.get):
        active = [a for a in active if a[2] >= start[uid]]
        offset = 0
        for off, n, _ in sorted(active):
            if offset + size[uid] <= off:
                break
            offset = max(offset, off + n)
        active.append((offset, size[uid], end[uid]))
        slots[uid], live[uid] = (offset, size[uid]), (start[uid], end[uid])
        top = max(top, offset + size[uid])
    return ArenaLayout(slots, live, views, {u: d for u, d in dtypes.items() if u in slots}, top)
