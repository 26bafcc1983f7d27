"""draft_policy: adaptive draft length — whether a lane keeps drafting, from what its rounds return and what a
round costs. Pure Python: the engine asks it each round; the backend declares the costs (Capabilities.round_cost).

A lane's rounds return T = 1 + accepted/rounds tokens on average (its own measurement, not a model of the
acceptance). A round of a B-lane bucket costs c(B) plain steps of the same bucket, measured by the backend at
start-up. Drafting pays while T ≥ c(B) · (1 + margin); once it does not for a lane that has run `min_rounds`
rounds, the lane drops to plain steps (K = 0) for the rest of the request — the decision is made once, so a
lane does not pay the transition (the pending fold, its row) back and forth.

Why only K or 0: on the GPU a lane asking k < K runs in the K-bucket (its verify computes K + 1 columns), so
its round costs what a K round costs and returns fewer tokens; K is never worse than a smaller k there. With
per-K buckets (a B·(k+1)-row round), c would depend on k and the choice would be argmax_k T(k) / c(B, k).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftPolicy:
    round_cost: dict[int, float]        # cohort bucket → a round's time over a plain step's (the backend's)
    min_rounds: int = 8                 # rounds a lane runs before it is judged
    margin: float = 0.02                # drafting must beat plain steps by this much to stay

    def cost(self, lanes: int) -> float | None:
        """The cost ratio of the smallest measured bucket ≥ `lanes` (None: not measured)."""
        sizes = sorted(b for b in self.round_cost if b >= lanes)
        return self.round_cost[sizes[0]] if sizes else None

    def keep_drafting(self, rounds: int, accepted: int, lanes: int) -> bool:
        """Whether a lane that ran `rounds` rounds keeping `accepted` drafts in all should go on drafting in a
        cohort of `lanes` speculative lanes."""
        cost = self.cost(lanes)
        if cost is None or rounds < self.min_rounds:
            return True
        return 1 + accepted / rounds >= cost * (1 + self.margin)
