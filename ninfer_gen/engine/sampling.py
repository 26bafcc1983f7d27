"""sampling: next-token choice from logits — greedy argmax, or temperature / top-k / top-p with a
seeded generator. The GPU runtime's on-device sampler must agree with these semantics."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0      # 0 → greedy
    top_k: int = 0                # 0 → no limit
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be ≥ 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be ≥ 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:                              # on the logits' device: one int comes back
            return int(torch.argmax(logits.reshape(-1)))
        logits = logits.float().cpu()
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p  # smallest prefix reaching top_p
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.gen))
