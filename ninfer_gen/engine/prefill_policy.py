"""prefill_policy: how many prompt tokens an engine step prefills while other lanes decode, so that the gap
between a decoding lane's tokens stays under a bound. Pure Python: the engine reports what its steps cost, in
its own clock; the policy keeps no model of the hardware beyond those measurements.

A step with decoding lanes prefills n prompt tokens (one lane's chunk, or several lanes' chunks of n in all) and
runs one round, so a decoding lane waits about
t_prefill(n) + t_round between its tokens. The policy keeps two running means, of a round's seconds and of the
seconds per prefilled token (every chunk's time over its tokens, so per-chunk overheads make small chunks look
dearer: the estimate errs toward smaller chunks, and grows as larger chunks show the real rate), and gives the
largest chunk of 16·2^i tokens (the prefill buckets' sizes) whose predicted step fits `gap_s` — at least `floor`
tokens, so a long prompt always advances, at most `most`. With no lane decoding there is no gap to keep: `most`.
Before any measurement it gives `floor`. A bound below a round plus a `floor` chunk cannot be kept: the prompt
then advances `floor` tokens per step (measured on the CPU, tiny spec, 3 lanes decoding, a 1,024-token prompt and
a 15 ms bound: gaps p99 33 ms instead of 65, its TTFT 1.46 s instead of 0.22 s).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillPacer:
    gap_s: float                        # the bound on a decoding lane's gap between tokens
    most: int                           # the largest chunk (the engine's prefill budget)
    floor: int = 16                     # the smallest chunk while lanes decode
    weight: float = 0.25                # of the newest measurement in the running means
    round_s: float | None = None        # running mean of a round's seconds
    token_s: float | None = None        # running mean of a prefill's seconds per token

    def __post_init__(self):
        if self.gap_s <= 0:
            raise ValueError(f"the gap bound must be positive, got {self.gap_s} s")
        if not 1 <= self.floor <= self.most:
            raise ValueError(f"the prefill chunk bounds must be 1 ≤ floor ≤ most, got {self.floor} and {self.most}")

    def budget(self, decoding: bool) -> int:
        """Prompt tokens the next step may prefill (`decoding`: lanes are waiting for their next token)."""
        if not decoding:
            return self.most
        if self.token_s is None:
            return self.floor
        room = (self.gap_s - (self.round_s or 0.0)) / self.token_s
        n = self.floor
        while n * 2 <= min(room, self.most):
            n *= 2
        return n

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.token_s = self._mean(self.token_s, seconds / tokens)

    def rounded(self, seconds: float) -> None:
        if seconds > 0:
            self.round_s = self._mean(self.round_s, seconds)

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.weight) * old + self.weight * new
