"""cohort_sampled_diag: session 17's cohort-tier failure — at 8 lanes the seeded sampled request (index 5 of
tests/gpu/test_cohort_gpu.py's 16) gave other tokens than alone, the greedy ones the same. Runs the tier's
requests alone and in cohorts of 2 / 4 / 8, with the prompts' pieces batched across lanes (`prefill_many`, the
default) and one lane at a time (the contract's default loop), and with request 5 greedy; prints per variant the
requests that differ from alone and where.

    python -m lab.cohort_sampled_diag
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import test_cohort_gpu as tier
    from ninfer_gen.api import load
    from ninfer_gen.cli.env import build_root
    from ninfer_gen.sampling import SamplingParams

    model = load(tier.SMALL, backend="gpu", cohorts=8, draft=3, max_context=tier.CONTEXT, build_root=build_root(),
                 prefix_states=4)
    lanes = model.lanes(8, prefix_cache=0)
    batched = lanes.prefill_many

    def one_at_a_time(chunks):
        out = {}
        for chunk in chunks:
            out.update(type(lanes).prefill_many(lanes, [chunk]))
        return out
    reqs = tier._requests()
    print("request 5:", len(reqs[5].prompt), "prompt tokens,", reqs[5].max_tokens, "tokens, draft", reqs[5].draft,
          reqs[5].sampling, flush=True)
    greedy5 = [*reqs[:5], dataclasses.replace(reqs[5], sampling=SamplingParams()), *reqs[6:]]
    for label, rs, many in (("batched", reqs, batched), ("one lane at a time", reqs, None),
                            ("batched, request 5 greedy", greedy5, batched)):
        lanes.prefill_many = many if many is not None else one_at_a_time
        alone = [tier._run(lanes, [r], 1)[0][0] for r in rs]
        for n in (2, 4, 8):
            got, _ = tier._run(lanes, rs, n)
            diff = {i: next((j for j, (a, b) in enumerate(zip(alone[i], got[i])) if a != b), None)
                    for i in range(len(rs)) if alone[i] != got[i]}
            print(f"{label}, {n} lanes: differing requests (first differing token) {diff}", flush=True)
    lanes.prefill_many = batched


if __name__ == "__main__":
    main()
