"""CPU logic of lanes.round_rows (the GPU lanes' row bookkeeping) on host tensors: which row each lane
takes, and that a sampled lane's first drafts' distributions reach its row — when it joins a kept layout,
when the layout is rebuilt (another bucket, compaction), and that lanes already placed carry theirs along."""
import torch

from compiler.kernels import spec_round as sr
from ninfer_gen.lanes.round_rows import FIELD, RoundRows

ROWS, K, V = 8, 3, 5


class _Inputs:
    def __init__(self):
        self.views = {"slots": torch.zeros(ROWS, dtype=torch.int32), "commit": torch.zeros(ROWS, dtype=torch.int32)}

    def set(self, *_):
        for v in self.views.values():
            v.zero_()

    def set_commit(self, counts):
        self.views["commit"].zero_()
        self.views["commit"][:len(counts)] = torch.tensor(counts, dtype=torch.int32)


class _Bucket:
    def __init__(self):
        self.inputs, self.runs, self.folded = _Inputs(), 0, []

    def run(self, graphs):
        self.runs += 1
        self.folded.append(self.inputs.views["commit"].tolist())


class _Backend:
    """What RoundRows reads of a GpuBackend: the round buffers, the profile's tail and options, the trash page,
    the buckets that fold (the commit buckets; with fold_in_verify the verifies of both record sets too)."""

    def __init__(self, fold_in_verify: bool = False):
        from compiler.options import CompileOptions

        self.profile = type("P", (), {"tail_tokens": K + 1, "snapshots": False, "record_sets": 1 + fold_in_verify,
                                      "options": CompileOptions(fold_in_verify=fold_in_verify)})()
        self.state = type("S", (), {"trash_page": 0})()
        self.exe = type("E", (), {"round_buffers": {
            "round": torch.zeros(ROWS * sr.ROW_WORDS, dtype=torch.int32),
            "tables": torch.zeros(ROWS * 4, dtype=torch.int32),
            "q_dist": torch.zeros(ROWS * K * V)}})()
        self.buckets = {e: _Bucket() for e in ("commit", "commit.rec1", "verify.rec", "verify.rec1")}
        self.commit = self.buckets["commit"]
        self.use_graphs = False
        self.allowed = set(self.buckets) if fold_in_verify else {"commit"}

    def bucket(self, entry, batch, tokens):
        assert entry in self.allowed, entry
        return self.buckets[entry]


class _Lane:
    def __init__(self, name: float):
        self.name = name
        self.private = type("P", (), {"pages": 0, "q": torch.full((K, V), name), "budget": 8, "k": K,
                                      "row": torch.zeros(sr.ROW_WORDS, dtype=torch.int32)})()
        self.seq = type("Q", (), {"table": type("T", (), {"pages": []})()})()


def _dists(rows: RoundRows) -> list[float]:
    return [float(q[0, 0]) for q in rows._draft_dists()]


def test_new_lanes_bring_their_first_draft_distributions_into_any_layout():
    rows = RoundRows(_Backend())
    a, b, c, d, e = (_Lane(x) for x in (1.0, 2.0, 3.0, 4.0, 5.0))
    rows.place([a, b], 2)                              # a first layout: both new
    assert rows.layout == [a, b] and _dists(rows)[:2] == [1.0, 2.0]
    assert a.private.q is None and a.private.pages == -1
    rows._draft_dists()[:2] = torch.tensor([10.0, 20.0]).view(2, 1, 1)   # the round drew the next drafts' q
    rows.vacate(a)                                     # a leaves; c and d join in the 4-row bucket
    rows.place([b, c, d], 4)
    assert rows.layout == [b, c, d, None]
    assert _dists(rows)[:3] == [20.0, 3.0, 4.0]        # b's q moved with it; c's and d's from their prompts
    rows.place([b, c, d, e], 4)                        # the same bucket: kept, e takes the free row
    assert rows.layout == [b, c, d, e] and _dists(rows)[:4] == [20.0, 3.0, 4.0, 5.0]


def test_a_lane_that_leaves_the_rounds_is_folded_and_idle_for_the_rest():
    """After leave(), the other lanes' rounds may go on without rewriting the rows (steady: the same bucket), so
    the leaving lane's device row must be IDLE then, not RUNNING with its old row."""
    be = _Backend()
    rows = RoundRows(be)
    a, b, c = _Lane(1.0), _Lane(2.0), _Lane(3.0)
    rows.place([a, b, c], 4)
    rows.write()
    assert rows.device[:3, FIELD["state"]].tolist() == [sr.RUNNING] * 3
    rows.fold_pending = True                           # the last round's records wait
    rows.leave(b)
    assert be.commit.runs == 1 and not rows.fold_pending
    assert rows.layout == [a, None, c, None] and rows.steady([a, c], 4)
    assert rows.device[:4, FIELD["state"]].tolist() == [sr.RUNNING, sr.IDLE, sr.RUNNING, sr.IDLE]


def test_a_rebuilt_layout_folds_the_pending_round_first():
    be = _Backend()
    rows = RoundRows(be)
    a, b = _Lane(1.0), _Lane(2.0)
    rows.place([a], 1)
    rows.fold_pending = True                           # a round ran: its accepted records wait for the fold
    rows.place([a, b], 2)
    assert be.commit.runs == 1 and not rows.fold_pending and rows.layout == [a, b]
    assert _dists(rows)[:2] == [1.0, 2.0]


class _Round:
    """A fused round of parity p as the device runs it: its verify folds the counts in its `commit` input, its
    accept writes the fold slots into the commit bucket of set p and the counts into the next verify's input."""

    def __init__(self, be, parity: int, emitted: list[int]):
        self.be, self.parity, self.emitted = be, parity, emitted

    def run(self, graphs):
        sets = ("rec", "rec1")
        verify = self.be.buckets[f"verify.{sets[self.parity]}"]
        verify.run(graphs)                                  # folds the previous round's records first
        own = self.be.buckets["commit" if self.parity == 0 else "commit.rec1"].inputs.views
        following = self.be.buckets[f"verify.{sets[1 - self.parity]}"].inputs.views
        own["slots"][:len(self.emitted)] = torch.arange(1, len(self.emitted) + 1, dtype=torch.int32)
        following["commit"][:len(self.emitted)] = torch.tensor(self.emitted, dtype=torch.int32)


class _Event:
    def record(self):
        pass

    def synchronize(self):
        pass


def test_rounds_that_fold_inside_the_next_verify_alternate_record_sets_and_flush_the_last(monkeypatch):
    """fold_in_verify: round N's counts reach round N+1's verify (the other record set), a flush folds the last
    round's records with its own set's commit bucket, a leaving lane's pending fold is dropped, and a fresh layout
    starts with nothing to fold."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)    # the rows' read-back events: no device here
    be = _Backend(fold_in_verify=True)
    rows = RoundRows(be, depth=2)
    a, b = _Lane(1.0), _Lane(2.0)
    rows.place([a, b], 2)
    rows.write()
    assert rows.in_verify and rows.parity == 0
    for parity, emitted in ((0, [2, 4]), (1, [1, 3]), (0, [4, 1])):
        assert rows.parity == parity
        rows.launch(_Round(be, parity, emitted))
        rows.collect()
    v0, v1 = be.buckets["verify.rec"], be.buckets["verify.rec1"]
    assert v0.folded[0][:2] == [0, 0] and v1.folded[0][:2] == [2, 4] and v0.folded[1][:2] == [1, 3]
    assert rows.parity == 1 and rows.fold_pending    # round 3 (set rec) waits for verify.rec1: flush it
    rows.vacate(b)                                      # b leaves first: its part of the fold is dropped
    rows.flush()
    assert be.buckets["commit"].folded == [[4, 0, 0, 0, 0, 0, 0, 0]] and be.buckets["commit.rec1"].runs == 0
    assert v1.inputs.views["commit"].sum() == 0 and not rows.fold_pending
    rows.place([a], 1)
    rows.write()                                        # a new layout: the next verify folds nothing
    assert be.buckets[f"verify.{('rec', 'rec1')[rows.parity]}"].inputs.views["commit"].sum() == 0
    eager = RoundRows(_Backend(fold_in_verify=True), depth=1, fused=False)
    assert not eager.in_verify                          # eager rounds fold with the commit bucket after each one
