"""speculative: MTP speculative decoding, the round's math stated once for every backend (a leaf: the lane
adapters in ninfer_gen.lanes drive it; the GPU's one-graph rounds run the same math in spec_round's kernels).

A round for one sequence of committed length L, with the anchor a (the last token chosen, not yet run
through the model) and K drafts d1..dK from the MTP head:
  verify   the target runs [a, d1..dK] at positions L..L+K in record mode (REPLAYSSM.md: the GDN state is
           read, never written; KV is written for all K+1 positions and later trimmed by length);
  accept   greedy: the longest prefix of drafts equal to the target's argmax, then the target's token
           after it. Sampling: speculative rejection sampling — draft i is kept with probability
           min(1, p(di)/q(di)) (p the target's, q the draft's distribution, both after temperature /
           top-k / top-p); at the first rejection a token is drawn from the normalised residual
           max(0, p − q); if all K are kept, a bonus token is drawn from the last target distribution.
           Each output token is then distributed exactly as plain sampling would draw it;
  truncate a stop token or the token budget ends the output early: only the emitted tokens count;
  commit   the first m = len(output) positions are folded into the state (the anchor and the kept
           drafts), the length becomes L + m, and the last output token is the next anchor;
  draft    the MTP head runs over slots L..L+m−1 (hidden of the verified positions, each with the next
           output token), which refills its KV cache for the committed span and predicts d1 from the
           last slot; d2..dK come from chained single-slot MTP steps that feed back the head's own
           normed output with the previous draft.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, distribution, draw


def accept_greedy(drafts: list[int], target_logits: torch.Tensor) -> list[int]:
    """The kept drafts (equal to the target's argmax at their position), then the target's next token."""
    best = target_logits.reshape(len(drafts) + 1, -1).argmax(-1).tolist()
    out = []
    for i, d in enumerate(drafts):
        if d != best[i]:
            break
        out.append(d)
    return out + [best[len(out)]]


def accept_sampled(drafts: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   gen: torch.Generator) -> list[int]:
    """Speculative rejection sampling over probability rows: draft_probs [K, V], target_probs [K+1, V]."""
    out = []
    for i, d in enumerate(drafts):
        p, q = float(target_probs[i, d]), float(draft_probs[i, d])
        if q > 0 and torch.rand((), generator=gen).item() < min(1.0, p / q):
            out.append(d)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
        total = float(residual.sum())
        out.append(draw(residual / total, gen) if total > 0 else draw(target_probs[i], gen))
        return out
    return out + [draw(target_probs[len(drafts)], gen)]


def truncate(tokens: list[int], stop_ids: set[int] | None, budget: int) -> list[int]:
    """The tokens a round emits: at most `budget`, ending at the first stop token (inclusive)."""
    out = []
    for t in tokens[:max(budget, 0)]:
        out.append(t)
        if stop_ids and t in stop_ids:
            break
    return out


@dataclass
class Stats:
    """What speculative decoding did for one request."""
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0                                      # tokens the rounds emitted (the prefill's first apart)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0


class Drafter:
    """The MTP head's side of a sequence: runs it over committed slots and chains K drafts."""

    def __init__(self, backend, params: SamplingParams, k: int, gen: torch.Generator):
        self.backend, self.params, self.k, self.gen = backend, params, k, gen

    def propose(self, seq, hidden: torch.Tensor, next_ids: list[int], start: int) -> tuple[list[int], torch.Tensor]:
        """MTP over slots start..start+n−1 (hidden rows with the token after each), then K−1 chained
        steps: (drafts [K], their distributions [K, V] when sampling, else None)."""
        logits, normed = self.backend.mtp(seq, hidden, next_ids, start)
        drafts, probs = [], []
        h, at = normed[-1:], start + len(next_ids)
        for j in range(self.k):
            if self.params.greedy:              # argmax where the logits are: one integer comes back
                d = int(logits[-1].argmax())
            else:
                q = distribution(logits[-1:], self.params)[0]
                d = draw(q, self.gen)
                probs.append(q)
            drafts.append(d)
            if j + 1 < self.k:
                logits, h = self.backend.mtp(seq, h, [d], at + j)
        return drafts, (torch.stack(probs) if probs else None)
