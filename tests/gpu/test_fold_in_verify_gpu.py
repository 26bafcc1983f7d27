"""GPU tier for CompileOptions.fold_in_verify (fused rounds with no commit step: each verify folds the previous
round's records of the other record set first): on the shipped small model, a cohort of 4 lanes (greedy and
seeded sampled, K = 3, lanes joining and finishing at different times, a prefix-cache second turn) gives the same
tokens as the default build, bit for bit, and its round graph launches fewer kernels (no commit step: two folds
per GDN layer gone).
Run: pytest -m gpu tests/gpu/test_fold_in_verify_gpu.py -q -s"""
import random
from pathlib import Path

import pytest

from ninfer_gen.cli.env import build_root

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "models/qwen3.8-small-py"


def _load(fold_in_verify: bool):
    from compiler.options import CompileOptions
    from ninfer_gen.api import load

    return load(SMALL, backend="gpu", cohorts=4, draft=3, max_context=1024, build_root=build_root(), prefix_states=4,
                compile_options=CompileOptions(fold_in_verify=fold_in_verify))


def _requests():
    from ninfer_gen.engine import Request
    from ninfer_gen.sampling import SamplingParams

    rng = random.Random(5)
    out = []
    for i in range(10):
        prompt = [rng.randrange(1, 4000) for _ in range(rng.choice([5, 40, 130]))]
        sampling = SamplingParams(temperature=0.9, top_k=40, seed=i) if i % 3 == 2 else SamplingParams()
        out.append(Request(prompt, rng.randint(10, 70), sampling, draft=3))
    return out


def _run(model):
    from ninfer_gen.engine import Engine, Request

    lanes = model.lanes(4, prefix_cache=4)
    engine = Engine(lanes, lanes=4, prefill_budget=64, max_queue=16)
    reqs = _requests()
    handles = [engine.submit(r) for r in reqs[:5]]
    for r in reqs[5:]:                                   # the rest join while others run and finish
        engine.step()
        handles.append(engine.submit(r))
    engine.run_until_idle()
    # a second turn of a request that ran last (the cache's 4 checkpoints no longer hold the ten requests' first ones)
    first = engine.submit(Request(list(reqs[0].prompt), 20, draft=3))
    engine.run_until_idle()
    again = engine.submit(Request(list(reqs[0].prompt) + first.tokens + [7, 8, 9], 20, draft=3))
    engine.run_until_idle()
    handles.append(first)
    finals = [h.result() for h in handles + [again]]
    assert all(f.finish == "length" for f in finals), [f.error for f in finals]
    usage = lanes.usage()
    assert usage["slots_in_use"] == 0 and again.final.stats.cached_tokens > 0
    rounds = lanes.round_graph(4, "greedy").launches
    return [h.tokens for h in handles + [again]], rounds


def test_rounds_that_fold_inside_the_verify_give_the_default_builds_tokens():
    default, rounds = _run(_load(False))
    folded, fewer = _run(_load(True))
    for i, (a, b) in enumerate(zip(default, folded)):
        assert a == b, f"request {i}: the folding rounds part from the default build"
    print(f"a C4 round: {rounds} launches by default, {fewer} folding inside the verify")
    assert rounds - fewer > 0
