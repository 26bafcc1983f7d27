"""small_eval: held-out scoring of the small model — bits per byte and MTP agreement — over
documents cut into overlapping windows, each window a fresh sequence at positions 0..T−1.

Calls `compiler.model.reference_forward`; owns no model math.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from compiler.model import reference_forward
from compiler.spec import ModelSpec

try:
    from tqdm import tqdm
except ImportError:      # the GPU machine has no tqdm; the training log still prints progress
    tqdm = None


class _NoBar:
    def __init__(self, iterable=None):
        self.iterable, self.n = iterable, 0

    def __iter__(self):
        return iter(self.iterable)

    def update(self, k: int = 1) -> None:
        self.n += k

    def close(self) -> None:
        pass


def progress_bar(iterable=None, **kwargs):
    """A tqdm bar (hidden when stderr is not a terminal), or a silent stand-in without tqdm."""
    return tqdm(iterable, disable=None, **kwargs) if tqdm is not None else _NoBar(iterable)


@dataclass(frozen=True)
class EvalSet:
    """Windows of T+1 tokens: input = [:, :T], target = [:, 1:]; `mask` marks scored targets."""
    name: str
    windows: torch.Tensor      # [N, T+1] int64, padded with the EOT id
    mask: torch.Tensor         # [N, T] bool
    n_bytes: int               # UTF-8 bytes of the documents (the bpb denominator)
    n_docs: int

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())


def _doc_windows(seq: list[int], seq_len: int, stride: int):
    """(window, first scored input index) pairs covering targets 1..len−1 exactly once; each
    window after the first keeps seq_len − stride tokens of context."""
    prev_end, begin = 1, 0
    while True:
        end = min(begin + seq_len + 1, len(seq))
        yield seq[begin:end], prev_end - begin - 1
        prev_end = end
        if end == len(seq):
            return
        begin += stride


def build_evalset(name: str, docs_ids: list[list[int]], n_bytes: int, eot: int, seq_len: int,
                  stride: int | None = None) -> EvalSet:
    """Each document is scored as `EOT doc` (it follows a separator, as in training)."""
    stride = stride or seq_len // 2
    rows, masks = [], []
    for ids in docs_ids:
        if not ids:
            continue
        for window, first in _doc_windows([eot, *ids], seq_len, stride):
            pad = seq_len + 1 - len(window)
            rows.append(window + [eot] * pad)
            masks.append([first <= j < len(window) - 1 for j in range(seq_len)])
    if not rows:
        raise ValueError(f"evaluation set {name!r} has no tokens")
    return EvalSet(name, torch.tensor(rows, dtype=torch.long), torch.tensor(masks), n_bytes, len(docs_ids))


def batch_losses(out: dict, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None):
    """(main CE, MTP CE) means over scored positions; MTP row i predicts target i+1 (token i+2)."""
    logits = out["logits"].float()
    main = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    mtp_logits = out["mtp_logits"].float()         # [B, T-1]: every row has a target
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1), targets[:, 1:].flatten(), reduction="none")
    mtp = mtp.view_as(targets[:, 1:])
    if mask is None:
        return main.mean(), mtp.mean()
    m = mask.float()
    return (main * m).sum() / m.sum().clamp(min=1), (mtp * m[:, 1:]).sum() / m[:, 1:].sum().clamp(min=1)


@torch.no_grad()
def _score_batch(spec: ModelSpec, params: dict, win: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sums for one batch: [CE nats, scored, top-1 hits, MTP-agree, MTP hits, MTP positions]."""
    inputs, targets = win[:, :-1], win[:, 1:]
    out = reference_forward(spec, params, inputs, with_mtp=True)
    logits = out["logits"].float()
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    main_top = logits.argmax(-1)
    mtp_top = out["mtp_logits"].float().argmax(-1)           # [B, T-1]; row i predicts target i+1
    m1 = mask[:, 1:]
    return torch.stack([
        (ce * mask).sum(), mask.sum(), ((main_top == targets) & mask).sum(),
        ((mtp_top == main_top[:, 1:]) & m1).sum(), ((mtp_top == targets[:, 1:]) & m1).sum(), m1.sum(),
    ]).double().cpu()


def evaluate(spec: ModelSpec, params: dict, evalset: EvalSet, batch_size: int,
             device: torch.device, max_windows: int | None = None) -> dict:
    """Bits per byte (Σ CE nats / ln 2 / bytes), per-token loss, top-1 accuracy, and MTP agreement:
    the fraction of positions i where argmax MTP(i) equals argmax main(i+1)."""
    n = evalset.windows.shape[0] if max_windows is None else min(max_windows, evalset.windows.shape[0])
    sums = torch.zeros(6, dtype=torch.float64)
    for lo in progress_bar(range(0, n, batch_size), desc=f"eval {evalset.name}", leave=False):
        win = evalset.windows[lo:min(lo + batch_size, n)].to(device)
        sums += _score_batch(spec, params, win, evalset.mask[lo:lo + win.shape[0]].to(device))
    ce, count, top1, agree, mtp_hits, mtp_count = sums.tolist()
    # A partial pass scales the byte count by the share of tokens scored.
    n_bytes = evalset.n_bytes * (count / evalset.n_tokens)
    return {"bits_per_byte": ce / math.log(2) / n_bytes, "loss_per_token": ce / count,
            "top1_accuracy": top1 / count, "mtp_agreement": agree / max(mtp_count, 1),
            "mtp_accuracy": mtp_hits / max(mtp_count, 1), "tokens": int(count), "bytes": int(round(n_bytes)),
            "bytes_per_token": n_bytes / count}


@torch.no_grad()
def greedy_sample(spec: ModelSpec, params: dict, tokenizer, prompt: str, n_tokens: int, eot: int,
                  device: torch.device) -> str:
    """Greedy continuation of `EOT prompt` (a fresh document), recomputing the whole sequence per token;
    stops at EOT. For the training log only: the runtime has its own cached decoder."""
    ids = [eot, *tokenizer.encode(prompt).ids]
    start = len(ids)
    for _ in range(n_tokens):
        logits = reference_forward(spec, params, torch.tensor([ids], device=device), with_mtp=False)["logits"]
        nxt = int(logits[0, -1].argmax())
        if nxt == eot:
            break
        ids.append(nxt)
    return prompt + tokenizer.decode(ids[start:])
