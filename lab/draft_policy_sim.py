"""draft_policy_sim: the adaptive draft length (ninfer_gen.engine.draft_policy) on a model of a cohort, to choose its
rule on the CPU before a GPU measures it. Each lane makes `tokens` tokens; a round of b drafting lanes costs
c(b)·step(b), a plain step of b lanes step(b) (buckets 1, 2, 4, 8), and while some lanes draft and others do not,
an engine step runs both. A draft is accepted with probability p, in order (the bench's coin), K drafts a round.

    python -m lab.draft_policy_sim            # the shipped policy (pooled over the cohort, as the engine asks it)
                                              # and session 13's per-lane rule vs plain and fixed K

The costs are the H100's of session 31 (27B, 32K draft head): rounds really cost what the cohort bench's decode rates
give (COSTS: 1.23 at C1, 1.66 at C8 — C2 and C4 scaled alike), a plain step of 8 lanes 1.32× one lane's (C8 plain
915 vs C1 151 decode tok/s). The policy is told TABLE — the start-up measurement on throwaway lanes (1.21 / 1.19 /
1.43 / 1.66 for 1 / 2 / 4 / 8 lanes) — or with `--told padded` PADDED, the graph replays of padded rows it was told
before (1.21 / 1.20 / 1.47 / 1.81: no GDN state moved). Session 15's costs (1.23 / 1.21 / 1.67 / 2.10, step(8) 1.49)
are kept as COSTS15 for `--costs 15`.
"""
from __future__ import annotations

import argparse
import random

from ninfer_gen.engine.draft_policy import DraftPolicy

TABLE = {1: 1.21, 2: 1.19, 4: 1.43, 8: 1.66}          # what the policy is told: start-up, throwaway lanes (s31)
PADDED = {1: 1.21, 2: 1.20, 4: 1.47, 8: 1.81}         # ... before: graph replays of padded rows (session 31)
COSTS = {1: 1.23, 2: 1.20, 4: 1.35, 8: 1.66}          # what a round costs in the engine (cohort bench, session 31)
COSTS15 = {1: 1.23, 2: 1.21, 4: 1.67, 8: 2.10}        # session 15's table, taken as true then
STEP_GROWTH = 0.046                                    # a plain step of b lanes: 1 + STEP_GROWTH·(b − 1) one-lane steps
BUCKETS = (1, 2, 4, 8)


def step_time(b: int) -> float:
    return 1.0 + STEP_GROWTH * (b - 1)


def bucket(n: int) -> int:
    return next(x for x in BUCKETS if x >= n)


def simulate(policy: DraftPolicy | None, lanes: int, p: float, k: int = 3, tokens: int = 256, seed: int = 0,
             fixed: bool = False, per_lane: bool = False, costs: dict | None = None) -> float:
    """Tokens per unit time (a one-lane plain step = 1) of `lanes` lanes; `policy` None with fixed False: plain.
    The policy is asked as the engine asks it (Engine._choose_drafts: the drafting lanes' pooled counts), or
    `per_lane` as session 13's engine did (each lane's own counts). `costs`: what rounds really cost (COSTS by
    default) — the policy's table (its round_cost) is its view, which may be off."""
    costs = costs or COSTS
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
                    if not policy.keep_drafting(rounds[i], accepted[i], k * rounds[i], len(spec)):
                        drafting[i] = False
            elif not policy.keep_drafting(sum(rounds[i] for i in spec), sum(accepted[i] for i in spec),
                                         k * sum(rounds[i] for i in spec), len(spec)):
                for i in spec:
                    drafting[i] = False
            spec = [i for i in live if drafting[i]]
        plain = [i for i in live if not drafting[i]]
        if spec:
            b = bucket(len(spec))
            t += costs[b] * step_time(b)
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


def table(policy: DraftPolicy, seeds: int = 40, costs: dict | None = None, ps=(0.2, 0.5, 0.8)) -> list[tuple]:
    """(lanes, p, adaptive/plain, adaptive/best of plain and fixed K, fixed/plain, per-lane rule/plain) at C1, C8."""
    rows = []
    for lanes in (1, 8):
        for p in ps:
            mean = lambda **kw: sum(simulate(seed=s, lanes=lanes, p=p, costs=costs, **kw)  # noqa: E731
                                    for s in range(seeds)) / seeds
            plain, fixed, adaptive = mean(policy=None), mean(policy=None, fixed=True), mean(policy=policy)
            old = mean(policy=DraftPolicy(policy.round_cost, min_rounds=8, margin=policy.margin, z=0.0), per_lane=True)
            rows.append((lanes, p, adaptive / plain, adaptive / max(plain, fixed), fixed / plain, old / plain))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--z", type=float, default=DraftPolicy({}).z, help="the policy's standard errors (0: the point "
                    "estimate, sessions 17–30)")
    ap.add_argument("--costs", choices=("31", "15"), default="31", help="31: rounds cost COSTS, the policy told "
                    "--told; 15: session 15's costs as both")
    ap.add_argument("--told", choices=("lanes", "padded"), default="lanes", help="the table the policy is told "
                    "(session 31): TABLE (throwaway lanes) or PADDED (padded graph replays)")
    args = ap.parse_args(argv)
    print(f"{'C':>2} {'p':>4} {'adaptive/plain':>15} {'adaptive/best':>14} {'fixed/plain':>12} {'per lane/plain':>15}")
    told, true = ({"lanes": TABLE, "padded": PADDED}[args.told], COSTS) if args.costs == "31" else (COSTS15, COSTS15)
    if args.costs == "15":
        global STEP_GROWTH
        STEP_GROWTH = 0.07
    for lanes, p, vs_plain, vs_best, fixed, old in table(DraftPolicy(told, z=args.z), args.seeds, true,
                                                          (0.2, 0.35, 0.5, 0.8)):
        print(f"{lanes:>2} {p:>4} {vs_plain:>15.3f} {vs_best:>14.3f} {fixed:>12.3f} {old:>15.3f}")


if __name__ == "__main__":
    main()
