"""CPU logic of lanes.round_rows (the GPU lanes' row bookkeeping) on host tensors: which row each lane
takes, and that a sampled lane's first drafts' distributions reach its row — when it joins a kept layout,
when the layout is rebuilt (another bucket, compaction), and that lanes already placed carry theirs along."""
import torch

from compiler.kernels import spec_round as sr
from ninfer_gen.lanes.round_rows import RoundRows

ROWS, K, V = 8, 3, 5


class _Inputs:
    def __init__(self):
        self.views = {"slots": torch.zeros(ROWS, dtype=torch.int32), "commit": torch.zeros(ROWS, dtype=torch.int32)}

    def set(self, *_):
        pass


class _Bucket:
    def __init__(self):
        self.inputs, self.runs = _Inputs(), 0

    def run(self, graphs):
        self.runs += 1


class _Backend:
    """What RoundRows reads of a GpuBackend: the round buffers, the profile's tail, the trash page, the
    commit bucket."""

    def __init__(self):
        self.profile = type("P", (), {"tail_tokens": K + 1})()
        self.state = type("S", (), {"trash_page": 0})()
        self.exe = type("E", (), {"round_buffers": {
            "round": torch.zeros(ROWS * sr.ROW_WORDS, dtype=torch.int32),
            "tables": torch.zeros(ROWS * 4, dtype=torch.int32),
            "q_dist": torch.zeros(ROWS * K * V)}})()
        self.commit = _Bucket()
        self.use_graphs = False

    def bucket(self, entry, batch, tokens):
        assert entry == "commit"
        return self.commit


class _Lane:
    def __init__(self, name: float):
        self.name = name
        self.private = type("P", (), {"pages": 0, "q": torch.full((K, V), name)})()


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


def test_a_rebuilt_layout_folds_the_pending_round_first():
    be = _Backend()
    rows = RoundRows(be)
    a, b = _Lane(1.0), _Lane(2.0)
    rows.place([a], 1)
    rows.fold_pending = True                           # a round ran: its accepted records wait for the fold
    rows.place([a, b], 2)
    assert be.commit.runs == 1 and not rows.fold_pending and rows.layout == [a, b]
    assert _dists(rows)[:2] == [1.0, 2.0]
