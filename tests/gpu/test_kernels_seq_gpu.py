"""GPU tier for the stateful kernel families: ReplaySSM's GDN record never writes the committed state,
fold of m records == m decode steps bit for bit, commit_record == fold then record, and the same for
the conv history. Run: pytest -m gpu tests/gpu -q."""
import pytest
import torch

import harness
from compiler.kernels import gdn_conv, gdn_step
from harness import TARGET
from lab.cases_seq import gdn_inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="session")
def h():
    return harness


@pytest.mark.parametrize("shape", [(2, 6, 32, 32, 3, 4), (16, 48, 128, 128, 4, 4)], ids=["tiny", "27b"])
def test_gdn_fold_equals_sequential_steps(h, shape):
    """ReplaySSM: record never writes S0; fold of m records == m decode steps, bit for bit (state, conv).
    The snapshot design too: its verify never writes S0 and restoring snapshot m == m decode steps."""
    hk, hv, dk, dv, b, t = shape
    rec_key = gdn_step.make_key(hk, hv, dk, dv, b, t, "record", TARGET)
    fold_key = gdn_step.make_key(hk, hv, dk, dv, b, t, "fold", TARGET)
    step_key = gdn_step.make_key(hk, hv, dk, dv, b, 1, "step", TARGET)
    g = torch.Generator(device="cuda").manual_seed(3)
    inp = gdn_inputs(rec_key, g)
    inp["slots"] = torch.arange(b, dtype=torch.int32, device="cuda")
    commit = torch.tensor([(0, t, 1, t - 1)[i % 4] for i in range(b)], dtype=torch.int32, device="cuda")
    s_fold, s_seq = inp["state"].clone(), inp["state"].clone()
    rk, rv = torch.empty(b, t, hk, dk, device="cuda").bfloat16(), torch.empty(b, t, hv, dv, device="cuda").bfloat16()
    rg, o_ver = torch.empty(b, t, hv, 2, device="cuda"), torch.empty(b, t, hv, dv, device="cuda")
    fixed = [inp["a_log"], inp["dt_bias"]]
    h.launch_key(rec_key, gdn_step, [o_ver, inp["qkv"], inp["a"], inp["b"], *fixed, s_fold, inp["slots"], rk, rv, rg,
                                      None, None, None, None, None])
    s_snap, snaps = inp["state"].clone(), torch.full((b, t, hv, dk, dv), float("nan"), device="cuda")
    o_snap = torch.empty_like(o_ver)
    h.launch_key(gdn_step.make_key(hk, hv, dk, dv, b, t, "snapshot", TARGET), gdn_step,
                 [o_snap, inp["qkv"], inp["a"], inp["b"], *fixed, s_snap, inp["slots"], *[None] * 7, snaps])
    torch.cuda.synchronize()
    assert h.same_bits(s_snap, inp["state"]), "snapshot mode wrote the committed state"
    assert h.same_bits(o_snap, o_ver), "snapshot and record verify outputs differ"
    h.launch_key(gdn_step.make_key(hk, hv, dk, dv, b, t, "restore", TARGET), gdn_step,
                 [*[None] * 6, s_snap, inp["slots"], None, None, None, commit, None, None, None, snaps])
    torch.cuda.synchronize()
    assert h.same_bits(s_fold, inp["state"]), "record mode wrote the committed state"
    s_before = s_fold.clone()
    h.launch_key(fold_key, gdn_step, [None, None, None, None, *fixed, s_fold, inp["slots"], rk, rv, rg, commit,
                                       None, None, None, None])
    for tt in range(t):
        slots_tt = torch.where(commit > tt, inp["slots"], -1).to(torch.int32)
        o_step = torch.full((b, 1, hv, dv), float("nan"), device="cuda")
        cols = [inp[n][:, tt:tt + 1].contiguous() for n in ("qkv", "a", "b")]
        h.launch_key(step_key, gdn_step, [o_step, *cols, *fixed, s_seq, slots_tt, *[None] * 8])
        torch.cuda.synchronize()
        live = commit > tt
        assert h.same_bits(o_step[live, 0], o_ver[live, tt]), f"token {tt}: verify output != decode output"
    assert h.same_bits(s_fold, s_seq), "fold != sequential decode steps"
    assert h.same_bits(s_snap, s_seq), "restored snapshot != sequential decode steps"
    _fused_commit_check(h, shape, s_before, (rk, rv, rg), commit, fixed, g)
    _conv_fold_check(h, 2 * hk * dk + hv * dv, b, t, commit, g)


def _fused_commit_check(h, shape, s0, prev, commit, fixed, g):
    """commit_record (fold the previous round, then verify) == fold, then record: same bits everywhere."""
    hk, hv, dk, dv, b, t = shape
    keys = {m: gdn_step.make_key(hk, hv, dk, dv, b, t, m, TARGET) for m in ("fold", "record", "commit_record")}
    nxt = gdn_inputs(keys["record"], g)
    slots = torch.arange(b, dtype=torch.int32, device="cuda")
    outs = {}
    for fused in (False, True):
        s = s0.clone()
        o = torch.full((b, t, hv, dv), float("nan"), device="cuda")
        rec = [torch.empty_like(prev[0]), torch.empty_like(prev[1]), torch.empty_like(prev[2])]
        cur = [o, nxt["qkv"], nxt["a"], nxt["b"], *fixed, s, slots, *rec]
        if fused:
            h.launch_key(keys["commit_record"], gdn_step, [*cur, commit, *prev, None])
        else:
            h.launch_key(keys["fold"], gdn_step, [None] * 4 + [*fixed, s, slots, *prev, commit, None, None, None, None])
            h.launch_key(keys["record"], gdn_step, [*cur, None, None, None, None, None])
        torch.cuda.synchronize()
        outs[fused] = [s, o, *rec]
    for name, a, c in zip(("state", "o", "rec_k", "rec_v", "rec_g"), outs[False], outs[True]):
        assert h.same_bits(a, c), f"commit_record {name} != fold then record"


def _conv_fold_check(h, c, b, t, commit, g):
    rec_key, fold_key = gdn_conv.Key(c, b, t, 4, "record", TARGET.arch), gdn_conv.Key(c, b, t, 4, "fold", TARGET.arch)
    upd_key = gdn_conv.Key(c, b, 1, 4, "update", TARGET.arch)
    x, w = torch.randn(b, t, c, generator=g, device="cuda").bfloat16(), torch.randn(c, 4, generator=g, device="cuda").bfloat16()
    hist = torch.randn(b, 3, c, generator=g, device="cuda").bfloat16()
    slots = torch.arange(b, dtype=torch.int32, device="cuda")
    h_fold, h_seq, rec = hist.clone(), hist.clone(), torch.empty_like(x)
    y_ver = torch.empty_like(x)
    h.launch_key(rec_key, gdn_conv, [y_ver, x, w, h_fold, slots, rec, None, None])
    h_fused, rec2, y_fused = hist.clone(), torch.empty_like(x), torch.empty_like(x)
    h.launch_key(gdn_conv.Key(c, b, t, 4, "commit_record", TARGET.arch), gdn_conv,
               [y_fused, x, w, h_fused, slots, rec2, commit, rec])
    h.launch_key(fold_key, gdn_conv, [None, None, None, h_fold, slots, rec, commit, None])
    for tt in range(t):
        y = torch.empty(b, 1, c, device="cuda").bfloat16()
        h.launch_key(upd_key, gdn_conv, [y, x[:, tt:tt + 1].contiguous(), w, h_seq,
                                          torch.where(commit > tt, slots, -1).to(torch.int32), None, None, None])
        torch.cuda.synchronize()
        assert h.same_bits(y[commit > tt, 0], y_ver[commit > tt, tt]), f"conv token {tt}: verify != decode"
    assert h.same_bits(h_fold, h_seq), "conv history fold != sequential updates"
    h.launch_key(rec_key, gdn_conv, [y_ver, x, w, h_fold, slots, rec, None, None])     # verify on the folded history
    torch.cuda.synchronize()
    assert h.same_bits(h_fused, h_fold) and h.same_bits(y_fused, y_ver) and h.same_bits(rec2, x), \
        "conv commit_record != fold then record"
