"""replicated: the cohort engine over tensor-parallel ranks (ninfer_gen.parallel, compiler.shard). The lead
(rank 0) runs the engine — and the server, the bench — over `ReplicatedLanes`; every other rank runs
`follow`. Each call the engine makes of its lane backend (open, prefill_many, round, release) is broadcast to the
followers before it runs: the call's name, its arguments and the public state of its lanes (lanes.contract.
LaneState without the adapter's `private` data and the sequence). A follower keeps a mirror of each lane,
brings it up to the lead's state and makes the same call on its own share of the model, so the collectives
inside the calls meet in the same order on every rank, and every rank's KV pages and GDN states hold the same
tokens. The engine's own decisions (admission, budgets, finishing, cancellation, timeouts) happen on the lead
only; a follower needs no engine.

The ranks choose the same tokens because their logits are the same bits (gathered) and their random streams
start from the same seed (a request's, or the generators' fixed default: ninfer_gen.sampling). Structured output
(a grammar's matcher is host state the messages do not carry) is refused with --tp for now.
"""
from __future__ import annotations

PUBLIC = ("lane", "prompt", "sampling", "stop", "k", "max_context", "prefilled", "cached", "finish", "anchor",
          "drafts", "budget", "tokens")


def _broadcast(message=None):
    """The lead's `message` on every rank (gloo: pickled objects)."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _public(lane) -> dict:
    return {name: getattr(lane, name) for name in PUBLIC}


class ReplicatedLanes:
    """The lead's LaneBackend: `inner`'s calls, each broadcast to the followers first. `close()` ends their
    loops (call it once the engine is done)."""

    def __init__(self, inner):
        self.inner = inner
        self.capacity, self.max_context, self.prefill_chunk = inner.capacity, inner.max_context, inner.prefill_chunk
        self.closed = False

    def __getattr__(self, name):                     # what else the engine or a bench reads of the adapter
        return getattr(self.inner, name)

    def validate(self, request) -> None:
        if request.constraint is not None:
            raise ValueError("structured output (a grammar) does not run with --tp yet")
        self.inner.validate(request)

    def open(self, lane) -> None:
        self._send("open", [lane])
        self.inner.open(lane)

    def prefill_many(self, chunks):
        self._send("prefill_many", [lane for lane, _, _ in chunks], [list(ids) for _, ids, _ in chunks],
                   [last for _, _, last in chunks])
        return self.inner.prefill_many(chunks)

    def round(self, lanes):
        self._send("round", lanes)
        return self.inner.round(lanes)

    def release(self, lane) -> None:
        self._send("release", [lane])
        self.inner.release(lane)

    def usage(self) -> dict[str, int]:
        return self.inner.usage()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _broadcast(("close", [], ()))

    def _send(self, op: str, lanes, *args) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel ranks were closed")
        _broadcast((op, [_public(lane) for lane in lanes], args))


def follow(inner) -> dict[str, int]:
    """A follower's loop: the lead's calls on `inner` (this rank's lane backend), until the lead closes.
    Returns `inner.usage()` at the end (every slot and page free when the lead released every lane)."""
    from ninfer_gen.lanes.contract import LaneState

    mirrors: dict[int, LaneState] = {}
    while True:
        op, states, args = _broadcast()
        if op == "close":
            return inner.usage()
        lanes = []
        for state in states:
            lane = mirrors.get(state["lane"]) if op != "open" else None
            if lane is None:
                lane = mirrors[state["lane"]] = LaneState(**{k: state[k] for k in ("lane", "prompt", "sampling", "stop",
                                                                                  "k", "max_context")})
            for name, value in state.items():
                setattr(lane, name, value)
            lanes.append(lane)
        try:
            if op == "prefill_many":
                inner.prefill_many(list(zip(lanes, *args)))
            else:
                getattr(inner, op)(*(lanes if op != "round" else [lanes]), *args)
        except Exception:               # noqa: BLE001 — the lead's own call fails the same way and reports it
            pass
        if op == "release":
            mirrors.pop(lanes[0].lane, None)
