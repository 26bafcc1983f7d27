"""contract: the one contract between the engine and a backend — `LaneState` (one request's row of the
cohort), `Capabilities` (what a backend declares it runs) and the `LaneBackend` ABC that both backends'
adapters implement (lanes.reference over the reference interpreter, lanes.gpu over the compiled kernels),
plus the small helpers every adapter shares (`check_request`, `choose`, `masked_verify`). A leaf: imports
no engine, no backend and no CUDA.

The engine (engine.engine) owns requests, lanes, scheduling, budgets and finishing; an adapter owns the
backend's sequences (state slot + KV pages), the numbers, each lane's RNG stream and its drafts. The
engine calls an adapter from one thread at a time (inside `Engine.step`), never concurrently.

LaneBackend — what an adapter provides:

  caps: Capabilities  lanes (state slots; the engine's `lanes` ≤ it), max_context (a lane's own limit
                      `LaneState.max_context` is ≤ it), prefill_chunk (the default prefill budget), max_draft
                      (any K in 0..max_draft is honoured per request), cohort sizes of compiled rounds, rounds
                      kept in flight, prefix checkpoints
  validate(request)   raise ValueError naming what this backend cannot run (a draft K, a token id out of
                      the vocabulary, ...); called at submit, before anything is held
  open(lane)          take a sequence for the lane (a cleared state slot, no pages yet): sets `lane.seq`; with
                      prefix reuse (lanes.reuse) it may restore a cached prefix of the prompt into it and set
                      `lane.prefilled` and `lane.cached` to its length: the engine prefills the rest
  prefill(lane, ids, last) -> int | None
                      run `ids`, the next chunk of `lane.prompt` (positions lane.length .. +len(ids)), into
                      the lane's KV and state. `last`: the chunk ends the prompt — return the first output
                      token (chosen with the lane's sampling parameters and RNG) and set `lane.anchor` to it;
                      else return None. A lane with images (`lane.images`): the chunk's placeholders take their
                      image tokens, and every call of the lane runs at its M-RoPE positions (lanes.images).
  prefill_many(chunks) -> dict[int, int | None | BaseException]
                      the chunks of one engine step, [(lane, ids, last)], one per lane: each lane's `prefill`
                      result, or the exception that failed that lane alone. The engine calls this; a backend may
                      run the chunks together (lanes.gpu batches their tail steps and MTP passes across lanes),
                      but a lane's result must be what its `prefill` alone gives. Default: one by one.
  round(lanes) -> dict[int, list[int] | BaseException]
                      one decode round over every decode-ready lane given (keyed by `lane.lane`). Per lane,
                      from its committed length L and anchor a (the last output token, not yet run):
                        K = 0: one step over [a] at L; one token chosen with the lane's sampling and RNG.
                        K > 0: verify [a, d1..dk] at L..L+k, k = min(K, max_context − L − 1), in record mode;
                               accept (greedy: speculative.accept_greedy, else accept_sampled with the
                               lane's RNG); commit the emitted tokens; drafts for the next round from the MTP.
                      With a constraint (`lane.constraint`, an engine.grammar.Grammar), every token is chosen
                      from logits masked by the grammar (disallowed: −inf): in a verify, row i by the grammar's
                      state after d1..di, so a draft the grammar refuses is rejected like any other.
                      The tokens are `speculative.truncate(out, lane.stop, lane.budget)`: 1 ≤ n ≤ lane.budget,
                      a stop token only last. A backend with rounds in flight may return the tokens of the
                      rounds that completed since the last call (one or more rounds; still 1 ≤ n ≤ budget: its
                      device rows carry the budget and the stop tokens), so `lane.length` lags the device. Afterwards: lane.length = L + n, lane.anchor = the last token,
                      lane.stats.rounds += 1 per round (or step) run, lane.stats.drafted += k,
                      lane.stats.accepted += drafts kept (before truncation).
                      A lane whose round failed maps to its exception (the engine releases it; its state is
                      void); an exception raised by `round` itself fails every lane of the call.
                      Lanes are independent: a lane's tokens must not depend on which other lanes run.
                      A lane's `k` may drop to 0 between rounds (adaptive draft length, engine.draft_policy):
                      it continues with plain steps.
  release(lane)       give back the lane's sequence (state slot and KV pages) in any state, even mid-round;
                      `lane.finish` says why (engine.requests.FINISH_REASONS): a normal end may leave a prefix checkpoint
  usage() -> dict     {"slots": n, "slots_in_use": n, "pages": n, "pages_in_use": n}

Per round a device adapter reads from each LaneState: `slot`, `length` (committed), `anchor`, `drafts`,
`k`, `budget`, `stop`, `sampling` (with its seed), `max_context`, `constraint`; it keeps its own per-lane
data (RNG state, draft distributions, pending MTP input, grammar matcher) in `lane.private`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from ninfer_gen.sampling import SamplingParams
from ninfer_gen.speculative import Stats


@dataclass(eq=False)
class LaneState:
    """One request's row of the cohort while it holds a lane."""
    lane: int                          # row 0..C−1, fixed while the request runs
    prompt: list[int]
    sampling: SamplingParams
    stop: frozenset[int]
    k: int                             # drafts per round asked (0: plain steps)
    max_context: int                   # tokens this lane's sequence may hold
    seq: Any = None                    # the backend's sequence (state slot + KV block table): `open`
    prefilled: int = 0                 # prompt tokens already run (the engine advances it)
    cached: int = 0                    # of them, restored from a prefix checkpoint at `open` (the adapter)
    finish: str | None = None          # why the lane ends, set by the engine before `release`
    anchor: int | None = None          # the last output token, not yet run through the model
    drafts: list[int] = field(default_factory=list)    # the drafts of the lane's current round (adapter)
    budget: int = 0                    # most tokens this round may emit (the engine sets it per round)
    tokens: list[int] = field(default_factory=list)    # output so far (the engine appends)
    stats: Stats = field(default_factory=Stats)        # rounds/drafted/accepted: adapter; emitted: engine
    private: Any = None                # the adapter's per-lane data
    constraint: Any = None             # the request's grammar (engine.grammar.Grammar), None: free text
    images: Any = None                 # the prompt's images (vision.preprocess.Processed), None: text only
    key: list[int] = field(init=False)  # the prompt as prefix checkpoints know it: the prompt, or with images
                                        # `prefix_key` (the adapter sets it at `open`)

    def __post_init__(self):
        self.key = self.prompt

    @property
    def slot(self) -> int:
        return self.seq.slot

    @property
    def length(self) -> int:
        """Committed tokens in the KV and state (the anchor is not among them)."""
        return self.seq.length if self.seq is not None else 0

    @property
    def room(self) -> int:
        """Positions left before the lane's context limit."""
        return self.max_context - self.length


@dataclass(frozen=True)
class Capabilities:
    """What a lane backend declares it runs (the engine and the composition root read these; nothing probes)."""
    lanes: int                          # the most lanes it holds at once (state slots)
    max_context: int                    # tokens one sequence may hold
    prefill_chunk: int                  # the default prefill budget (prompt tokens per step)
    max_draft: int                      # the largest K a request may ask (0: plain decode only)
    cohort_sizes: tuple[int, ...] = ()  # batch sizes of its compiled round buckets (GPU); () = any (reference)
    rounds_in_flight: int = 1           # rounds it keeps queued ahead of the host's read-back
    prefix_cache: int = 0               # prefix checkpoints it keeps (0: no prefix reuse)
    round_cost: tuple[tuple[int, float], ...] = ()   # (cohort bucket, a round's time / a plain step's), measured
                                                     # at start-up; () = not measured (no adaptive draft length)


class LaneBackend(ABC):
    """The contract every lane backend implements (the module docstring states each call's semantics)."""
    caps: Capabilities

    @property
    def capacity(self) -> int:
        return self.caps.lanes

    @property
    def max_context(self) -> int:
        return self.caps.max_context

    @property
    def prefill_chunk(self) -> int:
        return self.caps.prefill_chunk

    @abstractmethod
    def validate(self, request) -> None: ...
    @abstractmethod
    def open(self, lane: LaneState) -> None: ...
    @abstractmethod
    def prefill(self, lane: LaneState, ids: list[int], last: bool) -> int | None: ...
    @abstractmethod
    def round(self, lanes: list[LaneState]) -> dict[int, list[int] | BaseException]: ...

    def prefill_many(self, chunks: list[tuple[LaneState, list[int], bool]]) -> dict[int, int | None | BaseException]:
        out: dict[int, int | None | BaseException] = {}
        for lane, ids, last in chunks:
            try:
                out[lane.lane] = self.prefill(lane, ids, last)
            except Exception as err:
                out[lane.lane] = err
        return out
    @abstractmethod
    def release(self, lane: LaneState) -> None: ...
    @abstractmethod
    def usage(self) -> dict[str, int]: ...

    def check_draft(self, request) -> None:
        """The draft K a request asks, against `caps.max_draft` (every backend refuses the same way)."""
        if request.draft < 0:
            raise ValueError(f"draft must be ≥ 0, got {request.draft}")
        if request.draft > self.caps.max_draft:
            raise ValueError(f"this backend runs at most {self.caps.max_draft} drafts per round "
                             f"({'no MTP layer or no speculative buckets' if not self.caps.max_draft else 'its built K'}): "
                             f"ask for draft 0..{self.caps.max_draft}, not {request.draft}")


def check_request(request, vocab_size: int) -> None:
    """What every adapter refuses at submit: prompt ids outside the vocabulary, a grammar compiled for
    another vocabulary or one whose end is not among the request's stop tokens."""
    bad = [t for t in request.prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary of {vocab_size}")
    grammar = getattr(request, "constraint", None)
    if grammar is not None and grammar.vocab_size != vocab_size:
        raise ValueError(f"the constraint was compiled for a vocabulary of {grammar.vocab_size}, the model's "
                         f"is {vocab_size}")
    if grammar is not None and not grammar.eos_ids <= request.stop:
        raise ValueError(f"the constraint ends with tokens {sorted(grammar.eos_ids)} that are not among the "
                         "request's stop tokens: its output could not end")


def choose(lane: LaneState, logits: torch.Tensor) -> int:
    """The next token from one row of logits: the lane's sampler (`lane.private.sampler`), on the mask of its
    grammar (`lane.private.matcher`, which then consumes the token) if it has one."""
    matcher = lane.private.matcher
    if matcher is None:
        return lane.private.sampler(logits)
    token = lane.private.sampler(matcher.mask(logits))
    matcher.consume(token)
    return token


def masked_verify(matcher, drafts: list[int], v_logits: torch.Tensor) -> torch.Tensor:
    """Verify logits [K+1, V] with row i masked by the grammar's state after d1..di (the matcher is left as
    it was). Rows past the first draft the grammar refuses stay unmasked: that draft's own row refuses it
    (greedy: it is not the masked argmax; sampled: its target probability is 0), so acceptance stops there
    and the later rows are never read."""
    rows = v_logits.reshape(len(drafts) + 1, -1).clone()
    taken = 0
    try:
        for i in range(len(drafts) + 1):
            rows[i] = matcher.mask(rows[i])
            if i == len(drafts) or not matcher.allows(drafts[i]):
                break
            matcher.consume(drafts[i])
            taken += 1
    finally:
        matcher.rollback(taken)
    return rows
