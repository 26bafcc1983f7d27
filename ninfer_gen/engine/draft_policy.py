"""draft_policy: adaptive draft length — whether a cohort's drafting lanes keep drafting, from what their rounds
return and what a round costs. Pure Python: the engine asks it each round; the backend declares the costs
(Capabilities.round_cost).

The drafting lanes' rounds return T = 1 + accepted/rounds tokens per lane and round (pooled over the lanes: their
own measurement, not a model of the acceptance). A round of a B-lane bucket costs c(B) plain steps of the same
bucket, measured by the backend at start-up. Drafting pays while T ≥ c(B) · (1 + margin). After `min_rounds`
lane-rounds the lanes are judged every round, and they drop to plain steps (K = 0) together, for the rest of their
requests, only once T + z·se < c(B) · (1 + margin), se being T's standard error over the lane-rounds so far (a
round's kept drafts spread as a chain of coins at the measured acceptance: chain_variance). The decision is made
once, so a lane does not pay the transition (the pending fold, its row) back and forth — and so it waits for
evidence: judged on the point estimate after 16 lane-rounds (se ≈ 0.26 at acceptance 0.5), a C8 cohort at T ≈ 1.88
against c(8) = 1.81 (then measured on padded rows; lanes.round_costs now gives 1.66) dropped in 97 % of its
lane-rounds, 0.87× fixed K (27B, H100, session 31); with both fixes 1.00× fixed K there.

Why for the cohort and not per lane: an engine step with some lanes drafting and some not runs a round AND a plain
step, so a cohort split in two pays for both, while a lane riding along in a round that runs anyway costs almost
nothing (decode is bandwidth-bound). Per lane (session 13's rule, 8 rounds each), the 27B at C8 on the H100 gave
0.92× plain at acceptance 0.2 (`bench --adaptive`); lab/draft_policy_sim.py models the cohort with session 31's
costs: per lane 0.93× plain at p 0.2 and 0.64× at p 0.5 (the split cohort); pooled, ≥ 0.98× plain and ≥ 0.98× the
better of plain and fixed K at C1 and C8, p 0.2 / 0.35 / 0.5 / 0.8, told either start-up table.

Why only K or 0: on the GPU a lane asking k < K runs in the K-bucket (its verify computes K + 1 columns), so
its round costs what a K round costs and returns fewer tokens; K is never worse than a smaller k there. With
per-K buckets (a B·(k+1)-row round), c would depend on k and the choice would be argmax_k T(k) / c(B, k).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def chain_variance(q: float, k: int) -> float:
    """Variance of the drafts a round keeps when each of its k drafts is kept with probability q until the first
    rejection (P(a) = q^a (1 − q) for a < k, P(k) = q^k): the spread of one lane-round's count."""
    probs = [q ** a * (1 - q) for a in range(k)] + [q ** k]
    mean = sum(a * pa for a, pa in enumerate(probs))
    return max(0.0, sum(a * a * pa for a, pa in enumerate(probs)) - mean * mean)


@dataclass(frozen=True)
class DraftPolicy:
    round_cost: dict[int, float]        # cohort bucket → a round's time over a plain step's (the backend's)
    min_rounds: int = 16                # lane-rounds the drafting lanes run (together) before they are judged
    margin: float = 0.02                # drafting must beat plain steps by this much to stay
    z: float = 3.0                      # a drop waits until T is this many standard errors under that

    def cost(self, lanes: int) -> float | None:
        """The cost ratio of the smallest measured bucket ≥ `lanes` (None: not measured)."""
        sizes = sorted(b for b in self.round_cost if b >= lanes)
        return self.round_cost[sizes[0]] if sizes else None

    def keep_drafting(self, rounds: int, accepted: int, drafted: int, lanes: int) -> bool:
        """Whether `lanes` drafting lanes, which ran `rounds` lane-rounds drafting `drafted` and keeping `accepted`
        drafts in all, should go on drafting: yes unless even T's upper bound, T + z·se (se from chain_variance at
        the measured acceptance), stays under the cost — a drop is for good, so it waits for evidence."""
        cost = self.cost(lanes)
        if cost is None or rounds < self.min_rounds:
            return True
        t = 1 + accepted / rounds
        k = max(1, round(drafted / rounds))
        se = math.sqrt(chain_variance(min(1.0, accepted / drafted) if drafted else 0.0, k) / rounds)
        return t + self.z * se >= cost * (1 + self.margin)
