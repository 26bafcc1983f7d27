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


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Rows of probabilities after temperature, top-k and top-p (fp32, on the CPU); greedy: one-hot
    argmax. What `Sampler` draws from, and what speculative rejection sampling compares."""
    logits = logits.float().cpu().reshape(-1, logits.shape[-1])
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True, dim=-1)
        keep = torch.cumsum(sorted_p, -1) - sorted_p < params.top_p      # smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return probs / probs.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=gen))


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.params.greedy:                    # on the logits' device: one int comes back
            return int(torch.argmax(logits.reshape(-1)))
        return draw(distribution(logits, self.params)[0], self.gen)
