"""draft_policy_sim: the adaptive draft length (ninfer_gen.engine.draft_policy) on a model of a cohort, to choose its
rule on the CPU before a GPU measures it. Each lane makes `tokens` tokens; a round of b drafting lanes costs
c(b)·step(b), a plain step of b lanes step(b) (buckets 1, 2, 4, 8), and while some lanes draft and others do not,
an engine step runs both. A draft is accepted with probability p, in order (the bench's coin), K drafts a round.

    python -m lab.draft_policy_sim            # the shipped policy (pooled over the cohort, as the engine asks it)
                                              # and session 13's per-lane rule vs plain and fixed K

The default costs are the H100's of session 15 (27B, 32K draft head): c = 1.23 / 1.21 / 1.67 / 2.10 for 1 / 2 / 4 / 8
lanes; a plain step of 8 lanes 1.49× one lane's (C8 plain 768.8 vs C1 144.2 tok/s end to end).
"""
from __future__ import annotations

import argparse
import random

from ninfer_gen.engine.draft_policy import DraftPolicy

COSTS = {1: 1.23, 2: 1.21, 4: 1.67, 8: 2.10}
BUCKETS = (1, 2, 4, 8)


def step_time(b: int) -> float:
    return 1.0 + 0.07 * (b - 1)


def bucket(n: int) -> int:
    return next(x for x in BUCKETS if x >= n)


def simulate(policy: DraftPolicy | None, lanes: int, p: float, k: int = 3, tokens: int = 256, seed: int = 0,
             fixed: bool = False, per_lane: bool = False) -> float:
    """Tokens per unit time (a one-lane plain step = 1) of `lanes` lanes; `policy` None with fixed False: plain.
    The policy is asked as the engine asks it (Engine._choose_drafts: the drafting lanes' pooled counts), or
    `per_lane` as session 13's engine did (each lane's own counts)."""
    rng = random.Random(seed)
    made = [0] * lanes
    rounds = [0] * lanes
    accepted = [0] * lanes
    drafting = [policy is not None or fixed] * lanes
    t = 0.0
    while any(m < tokens for m in made):
        live = [i for i in range(lanes) if made[i] < tokens]
        spec = [i for i in live if drafting[i]]
        if policy is not None and not fixed and spec:
            if per_lane:
                for i in spec:
                    if not policy.keep_drafting(rounds[i], accepted[i], len(spec)):
                        drafting[i] = False
            elif not policy.keep_drafting(sum(rounds[i] for i in spec), sum(accepted[i] for i in spec), len(spec)):
                for i in spec:
                    drafting[i] = False
            spec = [i for i in live if drafting[i]]
        plain = [i for i in live if not drafting[i]]
        if spec:
            b = bucket(len(spec))
            t += COSTS[b] * step_time(b)
            for i in spec:
                a = 0
                while a < k and rng.random() < p:
                    a += 1
                rounds[i] += 1
                accepted[i] += a
                made[i] += 1 + a
        if plain:
            t += step_time(bucket(len(plain)))
            for i in plain:
                made[i] += 1
    return sum(min(m, tokens) for m in made) / t


def table(policy: DraftPolicy, seeds: int = 40) -> list[tuple]:
    rows = []
    for lanes in (1, 8):
        for p in (0.2, 0.5, 0.8):
            mean = lambda **kw: sum(simulate(seed=s, lanes=lanes, p=p, **kw) for s in range(seeds)) / seeds  # noqa: E731
            plain, fixed, adaptive = mean(policy=None), mean(policy=None, fixed=True), mean(policy=policy)
            old = mean(policy=DraftPolicy(policy.round_cost, min_rounds=8, margin=policy.margin), per_lane=True)
            rows.append((lanes, p, adaptive / plain, adaptive / max(plain, fixed), fixed / plain, old / plain))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=40)
    args = ap.parse_args(argv)
    print(f"{'C':>2} {'p':>4} {'adaptive/plain':>15} {'adaptive/best':>14} {'fixed/plain':>12} {'per lane/plain':>15}")
    for lanes, p, vs_plain, vs_best, fixed, old in table(DraftPolicy(COSTS), args.seeds):
        print(f"{lanes:>2} {p:>4} {vs_plain:>15.3f} {vs_best:>14.3f} {fixed:>12.3f} {old:>15.3f}")


if __name__ == "__main__":
    main()
