"""round_rows: the round-state rows of a GPU backend's cohort rounds (lanes.gpu) — which lane is in which row
of the current cohort bucket, each row's block table, the sampled rounds' draft distributions per row, the
fused rounds' pending fold, and the rounds in flight.

A fused round folds the previous round's accepted ReplaySSM records at its start; the records and the fold's
inputs are per row. So a lane keeps its row while the bucket stays the same, and before the rows change —
another bucket, compaction, a lane leaving, a host-driven verify that logs into the same record rows — every
round in flight is collected (`drain`) and the pending fold runs eagerly (`flush`).

Rounds in flight: while the layout stays, the device rows carry everything a round needs (length, anchor,
drafts, the budget left, stop tokens, RNG counter), so the host launches the next round before it reads the
last one back (`launch` copies the rows to a pinned buffer and records an event; `collect` waits for the
oldest). The host writes the rows from its mirrors (`write`) only when the layout changes, after a drain.
A row whose lane finished on the device (DONE) emits nothing in the rounds launched after it.

With CompileOptions.fold_in_verify there is no commit step in a fused round: round N's accepted records (record
set N mod 2) are folded by round N+1's verify (which writes the other set), from the counts round N's accept wrote
into that verify's `commit` input. `parity` is the set of the next round; a flush folds the last round's records
with the commit bucket of its set (compiler.round.record_buckets).
"""
from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass

import torch

from compiler.kernels import spec_round as sr
from compiler.round import record_buckets
from ninfer_gen.lanes.contract import LaneState
from ninfer_gen.sampling import SamplingParams

FIELD = {name: i for i, name in enumerate(sr.ROUND_FIELDS)}


def _f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def round_row(seq, anchor: int, drafts: list[int], k: int, params: SamplingParams, stop_ids, accept_prob,
              seed: int, trash_page: int) -> torch.Tensor:
    """The round-state row (host, int32 [ROW_WORDS]) of a lane whose prompt has been prefilled and drafted:
    RUNNING at the sequence's length with its anchor, drafts (`k` of them may be kept per round), stop tokens,
    sampling parameters and RNG seed (the round counter starts at 0; the budget is written per placement)."""
    stops = sorted(stop_ids or ())
    if len(stops) > sr.MAX_STOPS:
        raise ValueError(f"at most {sr.MAX_STOPS} stop tokens in a device round, got {len(stops)}")
    row = torch.zeros(sr.ROW_WORDS, dtype=torch.int32)
    values = {"length": seq.length, "anchor": anchor, "state": sr.RUNNING, "slot": seq.slot, "k": k,
              "trash": trash_page, "seed_lo": seed & 0x7FFFFFFF, "seed_hi": (seed >> 31) & 0x7FFFFFFF,
              "top_k": params.top_k, "temperature": _f32_bits(params.temperature), "top_p": _f32_bits(params.top_p),
              "n_stop": len(stops), "accept_prob": _f32_bits(accept_prob if accept_prob is not None else 0.0),
              "rope_delta": seq.positions.delta if seq.positions is not None else 0}
    for name, v in values.items():
        row[FIELD[name]] = v
    row[sr.DRAFTS_AT:sr.DRAFTS_AT + len(drafts)] = torch.tensor(drafts, dtype=torch.int32)
    row[sr.STOPS_AT:sr.STOPS_AT + len(stops)] = torch.tensor(stops, dtype=torch.int32)
    return row


def idle_rows(backend, rows: torch.Tensor, batch: int):
    """For a round capture (Executable.capture_round): every lane idle and nothing to fold in the `batch`-lane
    commit bucket (and, with fold_in_verify, the verifies' fold counts), so the warm-up touches no state;
    returns the function that puts them back."""
    saved = rows.clone()
    T, profile = backend.profile.tail_tokens, backend.profile
    folds = [backend.bucket("commit", batch, T).inputs]
    if profile.record_sets == 2:
        folds += [backend.bucket(*record_buckets(batch, T, p)[0]).inputs for p in (0, 1)]
    kept = [f.device.clone() for f in folds]
    rows[:, FIELD["state"]] = sr.IDLE
    for f in folds:
        f.set([], [], [], [])

    def restore():
        rows.copy_(saved)
        for f, k in zip(folds, kept):
            f.device.copy_(k)
    return restore


@dataclass
class Flight:
    """One launched round: its layout, the pinned copy of its rows (valid once `done`), the MTP pass's last
    hidden rows (prefix reuse) and the event that marks the copy."""
    layout: list
    rows: torch.Tensor
    done: torch.cuda.Event
    hidden: torch.Tensor | None


class RoundRows:
    """The rows of one GpuBackend's round buffers, for the lanes of a GpuLanes adapter. A lane's
    `private` carries `row` (its host mirror), `pages` (block-table pages written to its row) and `q` (the
    first drafts' distributions, sampled, until it takes a row)."""

    def __init__(self, backend, depth: int = 2, fused: bool = True):
        """`fused`: the rounds fold the previous round's records themselves (else the host runs the commit
        bucket after reading each round: lanes.gpu's eager mode)."""
        self.be, self.T = backend, backend.profile.tail_tokens
        self.k = self.T - 1
        self.depth = depth                               # rounds kept in flight (1: read back every round)
        self.device = backend.exe.round_buffers["round"].view(-1, sr.ROW_WORDS)
        self.tables = backend.exe.round_buffers["tables"].view(self.device.shape[0], -1)
        pinned = self.device.is_cuda
        self.ring = [torch.zeros(self.device.shape, dtype=torch.int32, pin_memory=pinned) for _ in range(depth + 1)]
        self._ring_at = 0
        self.device[:, FIELD["state"]] = sr.IDLE
        self.layout: list[LaneState | None] = []         # the lanes in the rows of the bucket now
        self.fold_pending = False                        # the last launched round's records are not folded yet
        self.inflight: deque[Flight] = deque()
        self.in_verify = fused and backend.profile.record_sets == 2
        self.parity = 0                                  # in_verify: the record set the next round writes

    # ------------------------------------------------------------ layout
    def steady(self, lanes: list[LaneState], batch: int) -> bool:
        """The rows already hold exactly these lanes in a bucket of `batch`: the next round can be launched
        without writing them (the device rows are ahead of the host's mirrors)."""
        placed = [lane for lane in self.layout if lane is not None]
        return len(self.layout) == batch and len(placed) == len(lanes) and all(lane in lanes for lane in placed)

    def place(self, lanes: list[LaneState], batch: int) -> None:
        """Rows of `batch` for `lanes` (nothing in flight): the same rows as before when the bucket is the same
        and every lane placed there is in this round (new lanes take free rows); else the pending fold first,
        then the lanes compacted into rows 0.. (with their draft distributions, for sampled rounds)."""
        assert not self.inflight, "place() with rounds in flight"
        keep = len(self.layout) == batch and all(lane is None or lane in lanes for lane in self.layout)
        if not keep:
            self.flush()
            old = {lane: r for r, lane in enumerate(self.layout) if lane is not None}
            self._move_draft_dists([(old[lane], r) for r, lane in enumerate(lanes) if lane in old])
            # the lanes that had rows keep their place in the compaction; new lanes take the rows between
            # them below, in order, with their first drafts' distributions
            self.layout = [lane if lane in old else None for lane in lanes] + [None] * (batch - len(lanes))
            for lane in old:
                lane.private.pages = -1
        for lane in lanes:
            if lane not in self.layout:
                r = self.layout.index(None)
                self.layout[r] = lane
                lane.private.pages = -1
                if lane.private.q is not None:           # the prompt's drafts' distributions (sampled)
                    self._draft_dists()[r].copy_(lane.private.q)
                lane.private.q = None

    def write(self) -> None:
        """The bucket's rows from the lanes' mirrors (placed lanes RUNNING with `private.budget`: what the engine
        gives them now less the tokens collected but not yet returned — the device counts it down from here —,
        the rest IDLE) and their block tables."""
        be, batch = self.be, len(self.layout)
        host = torch.zeros((batch, sr.ROW_WORDS), dtype=torch.int32)
        host[:, FIELD["state"]] = sr.IDLE
        host[:, FIELD["trash"]] = be.state.trash_page
        for r, lane in enumerate(self.layout):
            if lane is None:
                continue
            host[r].copy_(lane.private.row)
            host[r, FIELD["budget"]] = lane.private.budget
            host[r, FIELD["k"]] = lane.private.k
            host[r, FIELD["state"]] = sr.RUNNING
        self.device[:batch].copy_(host)
        if not self.fold_pending:                        # nothing of an earlier layout may be folded
            self._fold_bucket().inputs.set([], [], [], [])
            if self.in_verify:
                self._next_verify().inputs.set_commit([])
        self.tables_changed()

    def tables_changed(self) -> None:
        """Block-table rows of the placed lanes whose pages changed (ordered on the stream, no host wait)."""
        for r, lane in enumerate(self.layout):
            if lane is not None:
                self._table(r, lane)

    # ------------------------------------------------------------ rounds
    def launch(self, rnd, hidden: torch.Tensor | None = None) -> None:
        """Replay the round `rnd` (executable.Round of this bucket) and queue the read-back of its rows;
        `hidden` (prefix reuse): the MTP pass's input rows to keep a copy of, [batch, H]."""
        rnd.run(self.be.use_graphs)
        self.fold_pending = True
        if self.in_verify:
            self.parity = 1 - self.parity
        batch = len(self.layout)
        self._ring_at = (self._ring_at + 1) % len(self.ring)
        buf = self.ring[self._ring_at][:batch]
        buf.copy_(self.device[:batch], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.inflight.append(Flight(list(self.layout), buf, done, None if hidden is None else hidden.clone()))

    def collect(self) -> Flight:
        """Wait for the oldest round in flight; its rows (host) are valid until `depth` more launches."""
        flight = self.inflight.popleft()
        flight.done.synchronize()
        return flight

    def drain(self) -> list[Flight]:
        return [self.collect() for _ in range(len(self.inflight))]

    def flush(self) -> None:
        """Fold the last round's accepted records now (its commit bucket, eagerly) and clear its inputs.
        Needs nothing in flight (a later round would fold them again)."""
        assert not self.inflight, "flush() with rounds in flight"
        if self.fold_pending:
            fold = self._fold_bucket()
            if self.in_verify:                           # the counts wait in the next verify's input: fold them now
                counts = self._next_verify().inputs
                fold.inputs.views["commit"].copy_(counts.views["commit"])
                counts.set_commit([])
            fold.run(self.be.use_graphs)
            fold.inputs.set([], [], [], [])
            self.fold_pending = False

    def vacate(self, lane: LaneState) -> None:
        """The lane leaves (released; nothing in flight): nothing of its pending fold may reach its slot, which
        a new sequence may take before the next round, and its row is idle from now on."""
        if lane not in self.layout:
            return
        r = self.layout.index(lane)
        if self.fold_pending:
            views = self._fold_bucket().inputs.views
            views["slots"][r] = -1
            views["commit"][r] = 0
            if self.in_verify:
                self._next_verify().inputs.views["commit"][r] = 0
        self.device[r, FIELD["state"]] = sr.IDLE
        self.layout[r] = None

    def leave(self, lane: LaneState) -> None:
        """The lane continues without device rounds (nothing in flight): its pending fold is folded first, and its
        row is idle from now on — the other lanes' next round may be launched without rewriting the rows (`steady`:
        the same bucket), and a row left RUNNING there would verify and commit into the lane's sequence while the
        host steps it (session 15 on the H100: `run` with 5 and 8 prompts, adaptive K, one lane each parted from
        its solo tokens once a lane dropped to K = 0 and the rest kept their bucket)."""
        if lane in self.layout:
            self.flush()
            r = self.layout.index(lane)
            self.device[r, FIELD["state"]] = sr.IDLE
            self.layout[r] = None

    # ------------------------------------------------------------ parts
    def _fold_bucket(self):
        """The commit bucket of the last launched round's records."""
        if self.in_verify:
            return self.be.bucket(*record_buckets(len(self.layout), self.T, 1 - self.parity)[2])
        return self.be.bucket("commit", len(self.layout), self.T)

    def _next_verify(self):
        """in_verify: the verify of the next round, whose `commit` input holds the last round's counts."""
        return self.be.bucket(*record_buckets(len(self.layout), self.T, self.parity)[0])

    def _draft_dists(self) -> torch.Tensor | None:
        q = self.be.exe.round_buffers.get("q_dist")
        return None if q is None else q.view(self.device.shape[0], self.k, -1)

    def _move_draft_dists(self, moves: list[tuple[int, int]]) -> None:
        q = self._draft_dists()
        moves = [(a, b) for a, b in moves if a != b]
        if q is None or not moves:
            return
        src = torch.tensor([a for a, _ in moves], device=q.device)
        dst = torch.tensor([b for _, b in moves], device=q.device)
        q[dst] = q[src].clone()

    def _table(self, r: int, lane: LaneState) -> None:
        """The lane's block table into its row of the round's tables (when its pages changed): from pinned
        memory without waiting (torch's pinned allocator keeps the staging buffer until the copy ran)."""
        pages = lane.seq.table.pages
        if len(pages) == lane.private.pages:
            return
        row = torch.full((self.tables.shape[1],), self.be.state.trash_page, dtype=torch.int32)
        row[:len(pages)] = torch.tensor(pages, dtype=torch.int32)
        if self.tables.is_cuda:
            row = row.pin_memory()
        self.tables[r].copy_(row, non_blocking=True)
        lane.private.pages = len(pages)
