"""Adaptive draft length (engine.draft_policy): the decision from the drafting lanes' pooled tokens per round
against the backend's measured round cost, the engine dropping them to plain steps together and losslessly, and
the rule's outcome on lab/draft_policy_sim's model of a cohort, and the throwaway lanes its start-up cost table is
measured on (lanes.round_costs) leaving nothing behind."""
import dataclasses
import random

import pytest

from compiler.spec import load_spec
from ninfer_gen.api import TINY_SPEC
from ninfer_gen.engine import Engine, Request
from ninfer_gen.engine.draft_policy import DraftPolicy
from ninfer_gen.lanes.reference import ReferenceLanes
from ninfer_gen.reference import ReferenceBackend
from ninfer_gen.weights.random_weights import random_weights


def test_the_policy_keeps_drafting_while_rounds_pay_for_themselves():
    p = DraftPolicy({1: 1.3, 8: 2.5}, min_rounds=8, margin=0.0, z=0.0)        # z 0: the point estimate alone
    assert p.keep_drafting(rounds=3, accepted=0, drafted=9, lanes=1)            # too early to judge
    assert p.keep_drafting(rounds=10, accepted=3, drafted=30, lanes=1)          # 1.3 tokens per round = the cost
    assert not p.keep_drafting(rounds=10, accepted=2, drafted=30, lanes=1)      # 1.2 < 1.3
    assert not p.keep_drafting(rounds=10, accepted=14, drafted=30, lanes=5)     # 2.4 < the 8-lane bucket's 2.5
    assert p.keep_drafting(rounds=10, accepted=15, drafted=30, lanes=8)
    assert p.keep_drafting(rounds=10, accepted=0, drafted=30, lanes=9)          # no measured bucket holds 9
    assert not DraftPolicy({1: 1.0}, margin=0.1).keep_drafting(20, 0, 60, 1)    # 1.0 < 1.1, and no spread at q = 0
    assert DraftPolicy({1: 1.0}, margin=0.1).keep_drafting(15, 0, 45, 1)        # 16 lane-rounds by default
    assert DraftPolicy({1: 1.0}, margin=0.1).keep_drafting(20, 4, 60, 1)


def test_a_drop_waits_until_the_rounds_clearly_do_not_pay():
    """At C8 and acceptance 0.5 (T = 1.875 tokens a round) against a cost of 1.81: a point estimate 1.75 after 16
    lane-rounds is within the noise (se ≈ 0.27), so the lanes keep drafting; the same estimate over 400 lane-rounds
    (se ≈ 0.05) is clearly under the cost, and so is acceptance 0.2's 1.25 already after 16."""
    from ninfer_gen.engine.draft_policy import chain_variance

    assert chain_variance(0.0, 3) == 0 and chain_variance(1.0, 3) == 0
    assert abs(chain_variance(0.5, 3) - (0.5 * 0 + 0.25 * 1 + 0.125 * 4 + 0.125 * 9 - 0.875 ** 2)) < 1e-12
    assert abs(chain_variance(0.5, 1) - 0.25) < 1e-12                            # one coin
    p = DraftPolicy({8: 1.81})
    assert p.keep_drafting(rounds=16, accepted=12, drafted=48, lanes=8)          # T 1.75
    assert not p.keep_drafting(rounds=400, accepted=300, drafted=1200, lanes=8)   # T 1.75, se 0.05
    assert not p.keep_drafting(rounds=16, accepted=4, drafted=48, lanes=8)       # T 1.25
    assert p.keep_drafting(rounds=400, accepted=350, drafted=1200, lanes=8)      # T 1.875 ≥ 1.81 · 1.02


@pytest.fixture(scope="module")
def backend():
    spec = load_spec(TINY_SPEC)
    return ReferenceBackend(spec, random_weights(spec), device="cpu", max_sequences=4, max_context=512)


def _run(lanes, reqs, adaptive: bool):
    engine = Engine(lanes, lanes=4, max_queue=len(reqs), adaptive_draft=adaptive)
    handles = [engine.submit(r) for r in reqs]
    engine.run_until_idle()
    return [h.result() for h in handles], [h.tokens for h in handles], engine.stats()


@pytest.mark.parametrize("cost, dropped", [(50.0, True), (0.5, False)])
def test_lanes_whose_drafts_do_not_pay_drop_to_plain_steps_losslessly(backend, cost, dropped):
    """Random weights keep almost no draft (about 1 token per round): against a round that costs 50 steps the
    drafting lanes drop to K = 0 together once they ran 16 rounds between them, against one that costs half a step
    none does; either way each greedy request's tokens equal plain decoding's."""
    rng = random.Random(4)
    reqs = [Request([rng.randrange(1, 400) for _ in range(rng.randint(3, 12))], 24, draft=3) for _ in range(4)]
    lanes = ReferenceLanes(backend)
    lanes.caps = dataclasses.replace(lanes.caps, round_cost=((4, cost),))
    finals, tokens, stats = _run(lanes, reqs, adaptive=True)
    _, plain, _ = _run(ReferenceLanes(backend), [dataclasses.replace(r, draft=0) for r in reqs], adaptive=False)
    assert tokens == plain and all(f.finish == "length" for f in finals)
    by_k = stats["lane_rounds_by_k"]
    assert (by_k.get(0, 0) > 0) == dropped and by_k[3] > 0
    if dropped:                                        # judged once 16 lane-rounds had run (≤ 4 more in that step)
        assert 16 <= sum(f.stats.drafted for f in finals) // 3 < 16 + len(reqs)
        assert all(f.stats.drafted < 3 * 8 for f in finals)


def test_without_measured_costs_nothing_changes(backend):
    rng = random.Random(5)
    reqs = [Request([rng.randrange(1, 400) for _ in range(5)], 16, draft=2)]
    finals, _, stats = _run(ReferenceLanes(backend), reqs, adaptive=True)
    assert set(stats["lane_rounds_by_k"]) == {2} and finals[0].stats.drafted == 2 * finals[0].stats.rounds


def test_on_the_model_of_a_cohort_adaptive_stays_within_2_percent_of_plain_and_3_of_the_best():
    """lab/draft_policy_sim with the H100's costs (27B, session 31: rounds costing what the cohort bench measured): the
    issue's bounds at C1 and C8, acceptance 0.2 / 0.5 / 0.8, told the start-up table (throwaway lanes) — and told the
    padded replays' table (C8 1.81 against a true 1.66) too. On the padded table the point estimate (z 0) falls under
    them at C8, p 0.5 (0.94× the best: the GPU bench's 0.87×); the per-lane rule of session 13 to 0.64× plain."""
    from lab.draft_policy_sim import COSTS, PADDED, TABLE, table

    for told in (TABLE, PADDED):
        rows = table(DraftPolicy(told), seeds=12, costs=COSTS)
        for lanes, p, vs_plain, vs_best, _, old in rows:
            assert vs_plain >= 0.98 and vs_best >= 0.97, (told, lanes, p, vs_plain, vs_best)
    assert min(row[5] for row in table(DraftPolicy(TABLE), seeds=12, costs=COSTS)) < 0.8
    assert min(row[3] for row in table(DraftPolicy(PADDED, z=0.0), seeds=12, costs=COSTS)) < 0.97


@pytest.mark.parametrize("b", [1, 3])
def test_the_round_costs_throwaway_lanes_run_and_leave_nothing_behind(backend, b):
    """lanes.round_costs.throwaway_lanes (what the GPU's start-up times its rounds and plain steps on) holds b
    prefilled one-token lanes that run rounds and, dropped to K = 0, plain steps; on leaving — normally or by an
    exception — every slot and page is free again."""
    from ninfer_gen.lanes.round_costs import raise_failed, throwaway_lanes

    lanes = ReferenceLanes(backend)
    with throwaway_lanes(lanes, b, 3) as probe:
        assert lanes.usage()["slots_in_use"] == b and all(lane.length == 1 for lane in probe)
        raise_failed(lanes.round(probe))
        for lane in probe:
            lane.k = 0
        raise_failed(lanes.round(probe))
        assert all(lane.length > 2 for lane in probe)
    assert lanes.usage()["slots_in_use"] == 0 and lanes.usage()["pages_in_use"] == 0
    with pytest.raises(RuntimeError, match="a failed measurement"):
        with throwaway_lanes(lanes, b, 3):
            raise RuntimeError("a failed measurement")
    assert lanes.usage()["slots_in_use"] == 0 and lanes.usage()["pages_in_use"] == 0
