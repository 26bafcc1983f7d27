"""ReplaySSM in the reference interpreter (REPLAYSSM.md, its invariants are these tests): a verify step
never writes the committed GDN state or conv history; folding m logged tokens equals the one-token
recurrence run m times on those tokens bit for bit, for every m in 0..T, in every GDN layer; m = 0 is a
strict no-op; padded rows touch nothing. Against m plain steps (and a round whose drafts are all
rejected against one step) the interpreter agrees to fp32 rounding only: its matmuls see B·T rows in a
verify and B in a step (the GPU's GEMVs are batch-invariant, so there the GPU tier asks for the bits).
The fused pipeline keeps all of it (the record prims fuse their gates like the step)."""
from pathlib import Path

import pytest
import torch

from compiler.interpret import run_graph
from compiler.passes import run_pipeline
from compiler.reference_ops import gdn_recurrence, torch_dtype
from compiler.spec import load_spec
from compiler.trace import StatePools, record_avals, state_avals, trace
from ninfer_gen.weights.random_weights import random_weights

SPEC = load_spec(Path(__file__).parent.parent / "model_specs" / "qwen3.8-tiny.yaml")
POOLS = StatePools(num_pages=16, num_slots=2, pages_per_seq=8, kv_dtype="f32")
B, T = 2, 4


@pytest.fixture(scope="module")
def weights():
    return random_weights(SPEC)


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shape, generator=gen) * 0.5).to(torch_dtype(dt))
            for name, (shape, dt) in state_avals(SPEC, POOLS).items()}


def _records() -> dict:
    return {name: torch.full(shape, float("nan"), dtype=torch_dtype(dt))
            for name, (shape, dt) in record_avals(SPEC, B, T, "f32").items()}


def _inputs(tokens, start, slots=(1, 0)) -> dict:
    b = len(slots)
    return {"tokens": torch.tensor(tokens, dtype=torch.int32), "pos": torch.tensor([start] * b, dtype=torch.int32),
            "block_table": torch.arange(b * 8, dtype=torch.int32).reshape(b, 8),
            "slots": torch.tensor(slots, dtype=torch.int32)}


def _gdn(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items() if k.startswith("gdn.")}


@pytest.mark.usefixtures("one_thread")              # fold == replay bit for bit is our code's: one thread split
@pytest.mark.parametrize("fused", [False, True])
def test_verify_keeps_state_and_fold_equals_sequential_steps(weights, fused):
    prep = (lambda g: run_pipeline(g)) if fused else (lambda g: g)
    verify = prep(trace(SPEC, "verify", B, T, POOLS))
    commit = prep(trace(SPEC, "commit", B, T, POOLS))
    step = prep(trace(SPEC, "step", B, 1, POOLS))
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, SPEC.model.vocab_size, (B, T), generator=gen).tolist()
    for m in range(T + 1):
        state, records = _state(0), _records()
        before = _gdn(state)
        out = run_graph(verify, _inputs(tokens, 5), weights, state | records)
        for k, v in before.items():                              # invariant 1: verify never writes S0
            assert torch.equal(state[k], v), f"verify wrote {k}"
        assert torch.isfinite(out["logits"]).all()
        counts = {"slots": torch.tensor([1, 0], dtype=torch.int32), "commit": torch.tensor([m, m], dtype=torch.int32)}
        run_graph(commit, counts, weights, state | records)
        replayed = _replay(before, records, m)                   # the logged tokens, one step at a time
        for k in before:                                         # invariant 2: bit for bit, every layer
            assert torch.equal(state[k], replayed[k]), f"m = {m}: fold of {k} differs from {m} replayed steps"
        if m == 0:                                               # invariant 3: m = 0 reads and writes nothing
            assert all(torch.equal(state[k], v) for k, v in before.items())
        expected = _state(0)
        for t in range(m):                                       # m plain one-token steps from the same state
            run_graph(step, _inputs([[row[t]] for row in tokens], 5 + t), weights, expected)
        for k in before:
            assert torch.allclose(state[k], expected[k], rtol=1e-4, atol=1e-5), f"m = {m}: {k} vs {m} steps"


def _replay(before: dict, records: dict, m: int, slots=(1, 0)) -> dict:
    """The committed state after m tokens, each logged token run through the one-token recurrence
    (`reference_ops.gdn_recurrence`, what a decode step calls) and the conv history shifted by it."""
    out = {k: v.clone() for k, v in before.items()}
    sl = torch.tensor(slots, dtype=torch.int32)
    for name in (k for k in records if k.endswith(".conv")):
        layer = name.split(".")[1]
        hist, width = out[f"gdn.{layer}.conv"], out[f"gdn.{layer}.conv"].shape[-1]
        k_, v_, g_ = (records[f"rec.{layer}.{p}"] for p in ("k", "v", "g"))
        for t in range(m):
            q = torch.zeros_like(k_[:, t:t + 1])
            gdn_recurrence(q, k_[:, t:t + 1], v_[:, t:t + 1], g_[:, t:t + 1, :, 0], g_[:, t:t + 1, :, 1],
                           out[f"gdn.{layer}.state"], sl)
        for r, s in enumerate(slots):
            cols = torch.cat((hist[s], records[name][r, :m].transpose(0, 1)), dim=-1)
            hist[s] = cols[:, -width:]
    return out


def test_verify_logits_are_the_sequential_steps_logits(weights):
    """Verify over T tokens gives each position the logits of the one-token steps (to fp32 rounding:
    the matmuls see T rows instead of one), and writes KV for all T positions."""
    verify, step = trace(SPEC, "verify", B, T, POOLS), trace(SPEC, "step", B, 1, POOLS)
    tokens = [[5, 9, 11, 2], [7, 1, 3, 8]]
    state = _state(1)
    got = run_graph(verify, _inputs(tokens, 5), weights, state | _records())["logits"].reshape(B, T, -1)
    ref = _state(1)
    for t in range(T):
        lg = run_graph(step, _inputs([[row[t]] for row in tokens], 5 + t), weights, ref)["logits"]
        assert torch.allclose(got[:, t], lg, rtol=1e-4, atol=1e-4), f"position {t}"
    kv = [k for k in state if k.startswith("kv.")]
    assert kv and all(torch.equal(state[k], ref[k]) or torch.allclose(state[k], ref[k], atol=1e-5) for k in kv)


def test_all_rejected_round_is_one_plain_step(weights):
    """Every draft rejected: commit 1 (the anchor) leaves state and conv history as one plain step."""
    verify, commit, step = (trace(SPEC, e, B, t, POOLS) for e, t in (("verify", T), ("commit", T), ("step", 1)))
    tokens = [[4, 4, 4, 4], [6, 6, 6, 6]]
    state, records = _state(2), _records()
    run_graph(verify, _inputs(tokens, 3), weights, state | records)
    run_graph(commit, {"slots": torch.tensor([1, 0], dtype=torch.int32), "commit": torch.tensor([1, 1], dtype=torch.int32)},
              weights, state | records)
    plain = _state(2)
    run_graph(step, _inputs([[4], [6]], 3), weights, plain)
    assert all(torch.allclose(state[k], plain[k], rtol=1e-4, atol=1e-5) for k in _gdn(plain))


def test_padded_rows_touch_nothing(weights):
    verify, commit = trace(SPEC, "verify", B, T, POOLS), trace(SPEC, "commit", B, T, POOLS)
    state, records = _state(4), _records()
    before = {k: v.clone() for k, v in state.items()}
    run_graph(verify, _inputs([[1, 2, 3, 4]] * 2, 0, slots=(-1, -1)), weights, state | records)
    run_graph(commit, {"slots": torch.tensor([-1, -1], dtype=torch.int32), "commit": torch.tensor([3, 3], dtype=torch.int32)},
              weights, state | records)
    assert all(torch.equal(state[k], v) for k, v in before.items() if k.startswith("gdn."))
    assert all(torch.isnan(r).all() for r in records.values())       # no record row written either


@pytest.mark.parametrize("fused", [False, True])
def test_snapshot_mode_commits_the_same_state_as_replayssm(weights, fused):
    """The snapshot design (K+1 state copies, for comparison): its verify never writes the committed state
    and gives the same logits; its commit of m takes the snapshot after token m, which equals ReplaySSM's
    fold of m logged tokens (fp32 rounding: the snapshots come from a T-token pass, the fold from m)."""
    prep = (lambda g: run_pipeline(g)) if fused else (lambda g: g)
    graphs = {mode: (prep(trace(SPEC, "verify", B, T, POOLS, snapshots=mode == "snap")),
                     prep(trace(SPEC, "commit", B, T, POOLS, snapshots=mode == "snap"))) for mode in ("rec", "snap")}
    assert any(e.prim == ("gdn_step_snapshot" if fused else "gdn_recurrence_snapshot")
               for e in graphs["snap"][0].eqns)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, SPEC.model.vocab_size, (B, T), generator=gen).tolist()
    for m in (0, 1, T):
        states = {}
        for mode, (verify, commit) in graphs.items():
            state = _state(0)
            buffers = {name: torch.full(shape, float("nan"), dtype=torch_dtype(dt))
                       for name, (shape, dt) in record_avals(SPEC, B, T, "f32", mode == "snap").items()}
            before = _gdn(state)
            out = run_graph(verify, _inputs(tokens, 5), weights, state | buffers)
            assert all(torch.equal(state[k], v) for k, v in before.items()), f"{mode} verify wrote the state"
            counts = {"slots": torch.tensor([1, 0], dtype=torch.int32), "commit": torch.tensor([m, m], dtype=torch.int32)}
            run_graph(commit, counts, weights, state | buffers)
            states[mode] = (out["logits"], _gdn(state))
        assert torch.allclose(states["rec"][0], states["snap"][0], rtol=1e-5, atol=1e-5)
        for k, v in states["rec"][1].items():
            assert torch.allclose(states["snap"][1][k], v, rtol=1e-5, atol=1e-6), f"m = {m}: {k}"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("fused", [False, True])
def test_a_verify_that_folds_first_equals_commit_then_verify(weights, fused):
    """CompileOptions.fold_in_verify's graph: a verify writing the other record set that first folds the previous
    round's first m records (trace fold_from) leaves the state, logits and records of a commit followed by a
    plain verify, bit for bit — per row its own m (0 and T included) — unfused (folds, then the record prims)
    and fused (the commit_record prims, passes.fuse_fold_into_verify)."""
    prep = (lambda g: run_pipeline(g)) if fused else (lambda g: g)
    first = prep(trace(SPEC, "verify", B, T, POOLS))
    commit = prep(trace(SPEC, "commit", B, T, POOLS))
    verify = prep(trace(SPEC, "verify", B, T, POOLS, records="rec1"))
    folding = prep(trace(SPEC, "verify", B, T, POOLS, records="rec1", fold_from="rec"))
    if fused:
        prims = {e.prim for e in folding.eqns}
        assert {"gdn_conv_commit_record", "gdn_step_commit_record"} <= prims and not prims & {"gdn_fold", "gdn_conv_fold"}
    gen = torch.Generator().manual_seed(4)
    tokens = [torch.randint(0, SPEC.model.vocab_size, (B, T), generator=gen).tolist() for _ in range(2)]
    second = {name: torch.full(shape, float("nan"), dtype=torch_dtype(dt))
              for name, (shape, dt) in record_avals(SPEC, B, T, "f32", prefix="rec1").items()}
    for m in ((0, T), (2, 1)):
        counts = {"slots": torch.tensor([1, 0], dtype=torch.int32), "commit": torch.tensor(m, dtype=torch.int32)}
        outs, states = [], []
        for together in (False, True):
            state, records, later = _state(0), _records(), {k: v.clone() for k, v in second.items()}
            run_graph(first, _inputs(tokens[0], 5), weights, state | records)
            if together:
                out = run_graph(folding, _inputs(tokens[1], 5) | {"commit": counts["commit"]}, weights,
                                state | records | later)
            else:
                run_graph(commit, counts, weights, state | records)
                out = run_graph(verify, _inputs(tokens[1], 5), weights, state | later)
            outs.append((out["logits"], later))
            states.append(_gdn(state))
        assert torch.equal(outs[0][0], outs[1][0]), f"m = {m}: logits"
        assert all(torch.equal(outs[0][1][k], outs[1][1][k]) for k in second), f"m = {m}: this round's records"
        assert all(torch.equal(states[0][k], states[1][k]) for k in states[0]), f"m = {m}: the committed state"
