"""cohort_run: the small model's cohort workload that GPU tests of a compile option compare with the default build
(tests/gpu/test_fold_in_verify_gpu.py, test_chains_gpu.py): 10 greedy and seeded sampled requests through a 4-lane
engine, joining while others run and finish, then a second turn of the first prompt that restores its prefix."""
from __future__ import annotations

import random
from pathlib import Path

from ninfer_gen.cli.env import build_root

SMALL = Path(__file__).resolve().parents[2] / "models/qwen3.8-small-py"


def load_small(options):
    """The shipped small model on the GPU, 4 lanes, K = 3, 4 prefix checkpoints, built with `options`."""
    from ninfer_gen.api import load

    return load(SMALL, backend="gpu", cohorts=4, draft=3, max_context=1024, build_root=build_root(), prefix_states=4,
                compile_options=options)


def cohort_tokens(model, drafts=(3,)):
    """(each request's tokens, the lane adapter): each request drafts K from `drafts`; every request must finish
    by length and the second turn must restore a checkpoint."""
    from ninfer_gen.engine import Engine, Request
    from ninfer_gen.sampling import SamplingParams

    rng = random.Random(5)
    reqs = []
    for i in range(10):
        prompt = [rng.randrange(1, 4000) for _ in range(rng.choice([5, 40, 130]))]
        sampling = SamplingParams(temperature=0.9, top_k=40, seed=i) if i % 3 == 2 else SamplingParams()
        reqs.append(Request(prompt, rng.randint(10, 70), sampling, draft=rng.choice(drafts)))
    lanes = model.lanes(4, prefix_cache=4)
    engine = Engine(lanes, lanes=4, prefill_budget=64, max_queue=16)
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
    handles += [first, again]
    finals = [h.result() for h in handles]
    assert all(f.finish == "length" for f in finals), [f.error for f in finals]
    assert lanes.usage()["slots_in_use"] == 0 and again.final.stats.cached_tokens > 0
    return [h.tokens for h in handles], lanes
