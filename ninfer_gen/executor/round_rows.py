"""round_rows: the round-state rows of a GPU backend's cohort rounds (executor.gpu_lanes) — which lane is in
which row of the current cohort bucket, each row's block table, the sampled rounds' draft distributions per
row, and the fused rounds' pending fold.

A fused round folds the previous round's accepted ReplaySSM records at its start; the records and the fold's
inputs are per row. So a lane keeps its row while the bucket stays the same, a lane that leaves has its row's
pending fold cancelled (its slot may be reused before the next round), and before the rows change — another
bucket, compaction, a lane leaving the rounds, a host-driven verify that logs into the same record rows — the
pending fold runs eagerly first. `run` writes the rows from the lanes' host mirrors (LaneState.private.row, the
budget of this round, RUNNING; the other rows IDLE), replays a round graph and reads the rows back.
"""
from __future__ import annotations

import torch

from compiler.kernels import spec_round as sr
from ninfer_gen.engine.lanes import LaneState
from ninfer_gen.executor.device_rounds import _F


class RoundRows:
    """The rows of one GpuBackend's round buffers, for the lanes of a GpuLanes adapter. A lane's
    `private` carries `row` (its host mirror), `pages` (block-table pages written to its row) and `q` (the
    first drafts' distributions, sampled, until it takes a row)."""

    def __init__(self, backend):
        self.be, self.T = backend, backend.profile.tail_tokens
        self.k = self.T - 1
        self.device = backend.exe.round_buffers["round"].view(-1, sr.ROW_WORDS)
        self.tables = backend.exe.round_buffers["tables"].view(self.device.shape[0], -1)
        self.readback = torch.zeros(self.device.shape, dtype=torch.int32, pin_memory=self.device.is_cuda)
        self.device[:, _F["state"]] = sr.IDLE
        self.layout: list[LaneState | None] = []         # the lanes in the rows of the last round's bucket
        self.fold_pending = False                        # that round's accepted records are not folded yet

    def place(self, lanes: list[LaneState], batch: int) -> None:
        """Rows of `batch` for `lanes`: the same rows as the last round when the bucket is the same and every
        lane placed there is in this round (new lanes take free rows); else the pending fold first, then the
        lanes compacted into rows 0.. (with their draft distributions, for sampled rounds)."""
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

    def run(self, rnd) -> torch.Tensor:
        """Write the bucket's rows (placed lanes RUNNING with this round's budget, the rest IDLE) and block
        tables, replay the round `rnd` (executable.Round of this bucket) and read the rows back (host,
        synchronous: the round's tokens)."""
        be, batch = self.be, len(self.layout)
        host = torch.zeros((batch, sr.ROW_WORDS), dtype=torch.int32)
        host[:, _F["state"]] = sr.IDLE
        host[:, _F["trash"]] = be.state.trash_page
        for r, lane in enumerate(self.layout):
            if lane is None:
                continue
            host[r].copy_(lane.private.row)
            host[r, _F["budget"]] = lane.budget
            host[r, _F["state"]] = sr.RUNNING
            self._table(r, lane)
        self.device[:batch].copy_(host)
        if not self.fold_pending:                        # nothing of another driver's rounds may be folded
            self._fold_bucket().inputs.set([], [], [], [])
        rnd.run(be.use_graphs)
        self.fold_pending = True
        back = self.readback[:batch]
        back.copy_(self.device[:batch])
        return back

    def flush(self) -> None:
        """Fold the last round's accepted records now (its commit bucket, eagerly) and clear its inputs."""
        if self.fold_pending:
            fold = self._fold_bucket()
            fold.run(self.be.use_graphs)
            fold.inputs.set([], [], [], [])
            self.fold_pending = False

    def fold(self, lane: LaneState) -> None:
        """The lane's accepted tokens into its state now (before its state is saved)."""
        if lane in self.layout:
            self.flush()

    def vacate(self, lane: LaneState) -> None:
        """The lane leaves (released): nothing of its pending fold may reach its slot, which a new sequence
        may take before the next round."""
        if lane not in self.layout:
            return
        r = self.layout.index(lane)
        if self.fold_pending:
            views = self._fold_bucket().inputs.views
            views["slots"][r] = -1
            views["commit"][r] = 0
        self.layout[r] = None

    def leave(self, lane: LaneState) -> None:
        """The lane continues without device rounds: its pending fold is folded first."""
        if lane in self.layout:
            self.flush()
            self.layout[self.layout.index(lane)] = None

    # ------------------------------------------------------------ parts
    def _fold_bucket(self):
        return self.be.bucket("commit", len(self.layout), self.T)

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
        """The lane's block table into its row of the round's tables (when its pages changed)."""
        pages = lane.seq.table.pages
        if len(pages) == lane.private.pages:
            return
        row = torch.full((self.tables.shape[1],), self.be.state.trash_page, dtype=torch.int32)
        row[:len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.tables[r].copy_(row)
        lane.private.pages = len(pages)
