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
        def one_by_one(seqs, hiddens, ids, starts):
            return [self.backend.mtp(*job) for job in zip(seqs, hiddens, ids, starts)]
        return draft_together(one_by_one, [(self, seq, hidden, next_ids, start)])[0]


def draft_together(mtp_many, jobs) -> list[tuple[list[int], torch.Tensor | None]]:
    """Several sequences' `Drafter.propose`, their MTP passes and chained steps run together: `mtp_many(seqs,
    hiddens, next_ids, starts)` gives each sequence's (logits, normed), their last rows its last slot's; a job is
    (drafter, seq, hidden, next_ids, start). Each sequence's drafts are drawn from its own drafter's parameters
    and generator, in its own order: what it would draw alone. A drafter with K = 0 runs the pass only."""
    outs = mtp_many([j[1] for j in jobs], [j[2] for j in jobs], [j[3] for j in jobs], [j[4] for j in jobs])
    drafts, probs = [[] for _ in jobs], [[] for _ in jobs]
    live = [i for i, job in enumerate(jobs) if job[0].k]
    for step in range(max((job[0].k for job in jobs), default=0)):
        chained = []
        for i in live:
            drafter, logits = jobs[i][0], outs[i][0]
            if drafter.params.greedy:             # argmax where the logits are: one integer comes back
                d = int(logits[-1].argmax())
            else:
                q = distribution(logits[-1:], drafter.params)[0]
                d = draw(q, drafter.gen)
                probs[i].append(q)
            drafts[i].append(d)
            if step + 1 < drafter.k:
                chained.append(i)
        if chained:
            more = mtp_many([jobs[i][1] for i in chained], [outs[i][1][-1:] for i in chained],
                            [[drafts[i][-1]] for i in chained], [jobs[i][4] + len(jobs[i][3]) + step for i in chained])
            for i, out in zip(chained, more):
                outs[i] = out
        live = chained
    return [(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]
