"""cohort_sampled_diag: session 17's cohort-tier failure — at 8 lanes the seeded sampled request (index 5 of
tests/gpu/test_cohort_gpu.py's 16) gave other tokens than alone, the greedy ones the same. Runs the tier's
requests alone and in cohorts of 2 / 4 / 8, with the prompts' pieces batched across lanes (`prefill_many`, the
default) and one lane at a time (the contract's default loop), and with request 5 greedy; prints per variant the
requests that differ from alone and where. `--rows`: also logs request 5's round rows (as collected: counter,
length, emitted, tokens, drafts, accepted; and its first round's host drafts with q at each) alone and at 8 lanes,
and prints both up to the first round that differs.

    python -m lab.cohort_sampled_diag [--rows]
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rows_of(lanes, prompt: list[int], log: list) -> None:
    """Wraps the adapter's `_take` and `prefill_many` to log the rounds and first drafts of the lane with `prompt`."""
    from compiler.kernels import spec_round as sr
    from ninfer_gen.lanes.round_rows import FIELD

    take, prefill = type(lanes)._take, lanes.prefill_many

    def logged_take(flight):
        for r, lane in enumerate(flight.layout):
            if lane is not None and list(lane.prompt) == list(prompt) and lane.seq is not None:
                h = flight.rows[r]
                n = int(h[FIELD["emitted"]])
                log.append(("round", r, len(flight.layout), int(h[FIELD["counter"]]), int(h[FIELD["length"]]), n,
                            h[sr.OUT_AT:sr.OUT_AT + n].tolist(), h[sr.DRAFTS_AT:sr.DRAFTS_AT + 3].tolist(),
                            int(h[FIELD["accepted"]])))
        take(lanes, flight)

    def logged_prefill(chunks):
        out = prefill(chunks)
        for lane, _, last in chunks:
            if last and list(lane.prompt) == list(prompt) and lane.private.q is not None:
                q = lane.private.q
                log.append(("first drafts", lane.anchor, lane.drafts,
                            [float(q[i, d]) for i, d in enumerate(lane.drafts)], float(q.sum())))
        return out

    lanes._take, lanes.prefill_many = logged_take, logged_prefill


def rows(lanes, tier, reqs) -> None:
    """Session 17: the first drafts' q already differ (0.4918 alone, 0.4961 at 8 lanes, the same drafts) — the MTP's
    pass over the prompt gives other logits beside 7 lanes. A second run alone after the 8-lane run tells whether
    the pass depends on what the pages held before (a read of unwritten MTP KV) or on the other lanes' calls."""
    alone, cohort, again = [], [], []
    batched = lanes.prefill_many
    for log, group in ((alone, [reqs[5]]), (cohort, reqs), (again, [reqs[5]])):
        _rows_of(lanes, reqs[5].prompt, log)
        tier._run(lanes, group, len(group) if len(group) <= 8 else 8)
        del lanes._take
        lanes.prefill_many = batched
    print(f"first drafts alone {alone[:1]}\n  after the 8-lane run, alone again {again[:1]}", flush=True)
    for i, (a, c) in enumerate(zip(alone, cohort)):
        same = a[:1] + a[3:] == c[:1] + c[3:] if a[0] == "round" else a == c
        print(f"{i:3d} {'=' if same else 'DIFFERS'}\n    alone: {a}\n    8 lanes: {c}", flush=True)
        if not same:
            break


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
    if sys.argv[1:] == ["--rows"]:
        rows(lanes, tier, reqs)
        return
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
