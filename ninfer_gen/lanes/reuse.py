"""reuse: a lane adapter's prefix-reuse policy over its pool's PrefixCache (allocators.prefix) — where
checkpoints are made and how a new lane restores one. Computes nothing; imports no CUDA.

Checkpoints are committed states only: the end of each prompt's prefill (n = len(prompt)), the end of an
engine chunk that crossed a multiple of `checkpoint_every` prompt tokens, and the end of an answer that
finished normally (stop or length: n = prompt + output − 1, the last output token is not in the state yet;
a cancelled or failed request leaves none). A new lane restores the longest checkpoint that is a proper
prefix of its prompt and prefills only the rest (a prompt with images is matched by `lane.key`, in which each image
token stands for its picture's content: lanes.images.prefix_key) (`lane.prefilled` starts at n; `lane.cached` = n).

The MTP layer's KV lives in the same pages, but its last slots wait for the token after them: a lane with
drafts checkpoints its pending MTP input (`MtpTail`: the MTP KV holds slots 0..start−1, `hidden` the main
model's rows of slots start..n−1), and a lane with drafts restores only a checkpoint that has one, writing
the MTP slots from `start` on (so its pages from there are private copies). A lane without drafts reads
either kind and writes from n on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer_gen.allocators.prefix import PrefixCache

NORMAL_ENDS = ("stop", "length")


@dataclass(frozen=True)
class MtpTail:
    """The MTP's pending input at a checkpoint: slots start..n−1 (their hidden rows [n − start, H]) have
    not been run through the MTP layer, slots before `start` have."""
    start: int
    hidden: Any

    @classmethod
    def of(cls, start: int, rows) -> "MtpTail":
        return cls(start, rows.clone())          # its own copy: not a view that keeps a chunk's rows alive

    @property
    def nbytes(self) -> int:
        return self.hidden.numel() * self.hidden.element_size()


class PrefixReuse:
    """The policy for lanes over `pool` (a SequencePool with allocators.prefix's protocol): `capacity`
    checkpoints (and at most `max_bytes` of saved state), one every `checkpoint_every` prompt tokens at
    the chunk ends of a long prompt."""

    def __init__(self, pool, capacity: int, checkpoint_every: int = 4096, max_bytes: int | None = None):
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be ≥ 1 token, got {checkpoint_every}")
        self.cache = PrefixCache.on(pool, capacity, max_bytes)
        self.every = checkpoint_every

    def restore(self, lane) -> MtpTail | None:
        """At `open`, into the lane's fresh sequence: the longest checkpoint of the lane's prompt (for a
        lane with drafts, one with an MTP tail), or nothing. Returns the tail the lane's MTP must run over
        before its first chunk's rows (a lane with drafts), else None."""
        drafts = bool(lane.k)
        ck = self.cache.lookup(lane.key, (lambda c: c.payload is not None) if drafts else None)
        if ck is None or not self.cache.restore(ck, lane.seq, ck.payload.start if drafts else None):
            return None
        lane.prefilled = lane.cached = ck.n
        return ck.payload if drafts else None

    def after_chunk(self, lane, start: int, last: bool, tail) -> None:
        """The lane has committed a prefill chunk (prompt positions start..lane.length−1): a checkpoint at the
        prompt's end or at a `checkpoint_every` boundary; `tail()` makes the MTP's pending input (drafts only)."""
        if last or lane.length // self.every > start // self.every:
            self._save(lane, lane.key[:lane.length], tail() if lane.k else None)

    def at_release(self, lane, tail) -> None:
        """Before the lane's sequence goes back: its answer, if it finished normally; `tail()` makes the
        MTP's pending input (None without drafts). A lane that reached its context limit may have run a
        round without drafting, skipping an MTP pass: its checkpoint keeps no tail."""
        if lane.finish in NORMAL_ENDS and lane.seq is not None and lane.tokens:
            tokens = lane.key + lane.tokens[:-1]
            if len(tokens) == lane.length:       # every output token but the last is committed
                self._save(lane, tokens, tail() if lane.length < lane.max_context else None)

    def _save(self, lane, tokens: list[int], tail: MtpTail | None) -> None:
        self.cache.save(lane.seq, tokens, tail, tail.nbytes if tail is not None else 0)
