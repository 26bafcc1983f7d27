"""draft_policy: adaptive draft length — whether a cohort's drafting lanes keep drafting, from what their rounds
return and what a round costs. Pure Python: the engine asks it each round; the backend declares the costs
(Capabilities.round_cost).

The drafting lanes' rounds return T = 1 + accepted/rounds tokens per lane and round (pooled over the lanes: their
own measurement, not a model of the acceptance). A round of a B-lane bucket costs c(B) plain steps of the same
bucket, measured by the backend at start-up. Drafting pays while T ≥ c(B) · (1 + margin); once it does not after
`min_rounds` lane-rounds, every drafting lane drops to plain steps (K = 0) for the rest of its request — the
decision is made once, so a lane does not pay the transition (the pending fold, its row) back and forth.

Why for the cohort and not per lane: an engine step with some lanes drafting and some not runs a round AND a plain
step, so a cohort split in two pays for both, while a lane riding along in a round that runs anyway costs almost
nothing (decode is bandwidth-bound). Per lane (session 13's rule, 8 rounds each), the 27B at C8 on the H100 gave
0.92× plain at acceptance 0.2 (`bench --adaptive`); lab/draft_policy_sim.py models the cohort with that run's
costs: per lane 0.95× plain at p 0.2 and 0.73× at p 0.5 (fixed K 0.87×: the split cohort), pooled over 16
lane-rounds ≥ 0.99× plain and ≥ 0.98× the better of plain and fixed K at C1 and C8, p 0.2 / 0.5 / 0.8.

Why only K or 0: on the GPU a lane asking k < K runs in the K-bucket (its verify computes K + 1 columns), so
its round costs what a K round costs and returns fewer tokens; K is never worse than a smaller k there. With
per-K buckets (a B·(k+1)-row round), c would depend on k and the choice would be argmax_k T(k) / c(B, k).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftPolicy:
    round_cost: dict[int, float]        # cohort bucket → a round's time over a plain step's (the backend's)
    min_rounds: int = 16                # lane-rounds the drafting lanes run (together) before they are judged
    margin: float = 0.02                # drafting must beat plain steps by this much to stay

    def cost(self, lanes: int) -> float | None:
        """The cost ratio of the smallest measured bucket ≥ `lanes` (None: not measured)."""
        sizes = sorted(b for b in self.round_cost if b >= lanes)
        return self.round_cost[sizes[0]] if sizes else None

    def keep_drafting(self, rounds: int, accepted: int, lanes: int) -> bool:
        """Whether `lanes` drafting lanes, which ran `rounds` lane-rounds keeping `accepted` drafts in all, should
        go on drafting."""
        cost = self.cost(lanes)
        if cost is None or rounds < self.min_rounds:
            return True
        return 1 + accepted / rounds >= cost * (1 + self.margin)
