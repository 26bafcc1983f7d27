"""lanes.gpu_prompt on the CPU, over a fake backend that records its calls: one engine step's chunks go through
one target call; the MTP passes of every drafting or middle chunk share the first MTP call and the chained drafts
the next ones; a last chunk gets its first token, drafts and round row, a middle chunk its pass and a checkpoint;
a lane whose chunk cannot start fails alone. (The GPU tier runs the same path on the device.)"""
from types import SimpleNamespace

import torch

from compiler.kernels import spec_round as sr
from ninfer_gen.lanes.contract import LaneState
from ninfer_gen.lanes.gpu import _Lane
from ninfer_gen.lanes.gpu_prompt import run_chunks
from ninfer_gen.lanes.round_rows import FIELD
from ninfer_gen.sampling import SamplingParams

V = 50


def _one_hot(i: int) -> torch.Tensor:
    row = torch.zeros(1, V)
    row[0, i % V] = 1.0
    return row


class _Backend:
    """The target's first token is the chunk's sum mod V; the MTP predicts the token after its last input + 1."""
    spec = SimpleNamespace(vision=None)
    state = SimpleNamespace(trash_page=99)

    def __init__(self, full_slots=()):
        self.calls, self.full = [], set(full_slots)

    def encode(self, pixels, grids):
        raise AssertionError("no images here")

    def reserve(self, seq, length):
        if seq.slot in self.full:
            raise RuntimeError(f"no pages for slot {seq.slot}")

    def prefill_many(self, seqs, ids, all_hidden, images):
        self.calls.append(("target", [s.slot for s in seqs], [len(x) for x in ids]))
        out = []
        for s, x, keep in zip(seqs, ids, all_hidden):
            s.length += len(x)
            hidden = torch.arange(len(x), dtype=torch.float32)[:, None].expand(-1, 4)
            out.append((_one_hot(sum(x)), hidden if keep else hidden[-1:]))
        return out

    def mtp_many(self, seqs, hiddens, next_ids, starts):
        self.calls.append(("mtp", [s.slot for s in seqs], [len(x) for x in next_ids], list(starts)))
        return [(_one_hot(x[-1] + 1), h[-1:]) for x, h in zip(next_ids, hiddens)]


def _lane(i: int, prompt: list[int], k: int) -> LaneState:
    lane = LaneState(i, prompt, SamplingParams(), frozenset(), k, 1000)
    lane.seq = SimpleNamespace(length=0, slot=i, positions=None)
    lane.private = _Lane(lane)
    return lane


def test_a_steps_chunks_run_together_and_each_lane_gets_what_it_would_alone():
    be = _Backend(full_slots={3})
    points = []
    adapter = SimpleNamespace(be=be, T=4, k=3, max_context=1000, accept_prob=None,
                              _room_for_round=lambda length: True,
                              _checkpoint=lambda lane, start, last, tail: points.append((lane.lane, start, last)))
    drafting, middle, plain, full = (_lane(0, [1, 2, 3, 4, 5], 3), _lane(1, list(range(10, 40)), 3),
                                     _lane(2, [7, 8], 0), _lane(3, [9], 3))
    out = run_chunks(adapter, [(drafting, [1, 2, 3, 4, 5], True), (middle, list(range(10, 26)), False),
                               (plain, [7, 8], True), (full, [9], True)])
    assert isinstance(out.pop(3), RuntimeError) and out == {0: 15, 1: None, 2: 15}
    # one target call for the three lanes that could start; the MTP passes of lanes 0 and 1 together, then lane 0's
    # two chained drafts
    assert be.calls == [("target", [0, 1, 2], [5, 16, 2]), ("mtp", [0, 1], [5, 16], [0, 0]),
                        ("mtp", [0], [1], [5]), ("mtp", [0], [1], [6])]
    assert drafting.anchor == 15 and drafting.drafts == [16, 17, 18] and drafting.private.q is None
    row = drafting.private.row
    assert int(row[FIELD["anchor"]]) == 15 and row[sr.DRAFTS_AT:sr.DRAFTS_AT + 3].tolist() == [16, 17, 18]
    assert middle.anchor is None and middle.private.row is None and middle.drafts == []
    assert plain.anchor == 15 and plain.private.row is None
    assert points == [(0, 0, True), (1, 0, False), (2, 0, True)]


def test_a_failed_call_fails_the_lanes_in_it():
    class Broken(_Backend):
        def mtp_many(self, *args):
            raise RuntimeError("mtp failed")

    adapter = SimpleNamespace(be=Broken(), T=4, k=3, max_context=1000, accept_prob=None,
                              _room_for_round=lambda length: True, _checkpoint=lambda *a: None)
    a, b = _lane(0, [1, 2], 3), _lane(1, [3, 4], 0)
    out = run_chunks(adapter, [(a, [1, 2], True), (b, [3, 4], True)])
    assert set(out) == {0, 1} and isinstance(out[0], RuntimeError) and out[1] == 7   # the plain lane needs no MTP
