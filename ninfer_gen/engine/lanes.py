"""lanes: the contract between the engine and a backend's rounds — `LaneState` (one request's row of the
cohort) and the `LaneBackend` protocol — and `ReferenceLanes`, the adapter over the reference backend,
which runs every lane's round host-side with engine.speculative's functions. Imports no CUDA.

The engine (engine.engine) owns requests, lanes, scheduling, budgets and finishing; an adapter owns the
backend's sequences (state slot + KV pages), the numbers, each lane's RNG stream and its drafts. The
engine calls an adapter from one thread at a time (inside `Engine.step`), never concurrently.

LaneBackend — what an adapter provides (the GPU adapter implements the same):

  capacity: int       the most lanes it holds at once (state slots); the engine's `lanes` ≤ capacity
  max_context: int    tokens one sequence may hold; a lane's own limit (`LaneState.max_context`) is ≤ it
  prefill_chunk: int  the engine's default prefill budget (prompt tokens per step)
  validate(request)   raise ValueError naming what this backend cannot run (a draft K, a token id out of
                      the vocabulary, ...); called at submit, before anything is held
  open(lane)          take a sequence for the lane (a cleared state slot, no pages yet): sets `lane.seq`; with
                      prefix reuse (engine.reuse) it may restore a cached prefix of the prompt into it and set
                      `lane.prefilled` and `lane.cached` to its length: the engine prefills the rest
  prefill(lane, ids, last) -> int | None
                      run `ids`, the next chunk of `lane.prompt` (positions lane.length .. +len(ids)), into
                      the lane's KV and state. `last`: the chunk ends the prompt — return the first output
                      token (chosen with the lane's sampling parameters and RNG) and set `lane.anchor` to it;
                      else return None.
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
                      a stop token only last. Afterwards: lane.length = L + n, lane.anchor = the last token,
                      lane.stats.drafted += k, lane.stats.accepted += drafts kept (before truncation).
                      A lane whose round failed maps to its exception (the engine releases it; its state is
                      void); an exception raised by `round` itself fails every lane of the call.
                      Lanes are independent: a lane's tokens must not depend on which other lanes run.
  release(lane)       give back the lane's sequence (state slot and KV pages) in any state, even mid-round;
                      `lane.finish` says why (engine.requests.FINISH_REASONS): a normal end may leave a prefix checkpoint
  usage() -> dict     {"slots": n, "slots_in_use": n, "pages": n, "pages_in_use": n}

Per round a device adapter reads from each LaneState: `slot`, `length` (committed), `anchor`, `drafts`,
`k`, `budget`, `stop`, `sampling` (with its seed), `max_context`, `constraint`; it keeps its own per-lane
data (RNG state, draft distributions, pending MTP input, grammar matcher) in `lane.private`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ninfer_gen.engine.reuse import MtpTail, PrefixReuse
from ninfer_gen.engine.sampling import Sampler, SamplingParams, distribution
from ninfer_gen.engine.speculative import Drafter, Stats, accept_greedy, accept_sampled, truncate


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
    stats: Stats = field(default_factory=Stats)        # drafted/accepted: adapter; rounds/emitted: engine
    private: Any = None                # the adapter's per-lane data
    constraint: Any = None             # the request's grammar (engine.grammar.Grammar), None: free text

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


class LaneBackend(Protocol):
    capacity: int
    max_context: int
    prefill_chunk: int

    def validate(self, request) -> None: ...
    def open(self, lane: LaneState) -> None: ...
    def prefill(self, lane: LaneState, ids: list[int], last: bool) -> int | None: ...
    def round(self, lanes: list[LaneState]) -> dict[int, list[int] | BaseException]: ...
    def release(self, lane: LaneState) -> None: ...
    def usage(self) -> dict[str, int]: ...


@dataclass
class _Private:
    sampler: Sampler                   # seeded from the request's seed; its generator also draws drafts
    pending: tuple | None = None       # (hidden rows, next ids, start): the MTP input of the next drafts
    draft_probs: torch.Tensor | None = None
    matcher: Any = None                # the grammar's state after the lane's output (engine.grammar.Matcher)
    tail: MtpTail | None = None        # a restored prefix's MTP input, run with the first prefill chunk


class ReferenceLanes:
    """LaneBackend over a ReferenceBackend. Each lane's round is its own B = 1 calls (verify → commit
    per lane: the reference keeps one ReplaySSM record buffer per verify shape), so a lane's tokens are
    bit-identical to the same request run alone. `batch_steps=True` runs the K = 0 lanes of a round as
    one B-row step instead — faster on the CPU, but its rows agree with B = 1 only to fp32 rounding
    (CPU matmuls are not batch-invariant), so a greedy token may flip at a near-tie."""

    def __init__(self, backend, *, batch_steps: bool = False, prefix_cache: int = 0, checkpoint_every: int = 4096):
        """`prefix_cache`: checkpoints kept for prefix reuse (engine.reuse; 0: none), one every
        `checkpoint_every` tokens of a long prompt."""
        self.backend, self.batch_steps = backend, batch_steps
        self.reuse = PrefixReuse(backend, prefix_cache, checkpoint_every) if prefix_cache else None
        self.capacity = backend.slots.num_slots
        self.max_context = backend.max_context
        self.prefill_chunk = backend.spec.runtime.prefill_chunk
        self.vocab_size = backend.spec.model.vocab_size
        self.has_mtp = bool(backend.spec.model.mtp.num_layers)

    @classmethod
    def for_model(cls, model, lanes: int, prefix_cache: int = 16, **kw) -> "ReferenceLanes":
        """Lanes over a loaded reference Model, with a prefix cache of `prefix_cache` checkpoints; when its
        backend has fewer state slots than `lanes`, the model gets a backend with enough (the same weights,
        device, dtypes and context)."""
        from ninfer_gen.reference import ReferenceBackend

        b = model.backend
        if not isinstance(b, ReferenceBackend):
            raise ValueError(f"ReferenceLanes runs on the reference backend, not the {type(b).__name__}")
        if b.slots.num_slots < lanes:
            b = ReferenceBackend(b.spec, b.weights, device=str(b.device), dtype={"f32": "float32"}.get(b.act, "bfloat16"),
                                 kv_dtype=b.pools.kv_dtype, max_sequences=lanes, max_context=b.max_context,
                                 bf16_matmul_inputs=b.bf16_matmul_inputs)
            model.backend = b
        return cls(b, prefix_cache=prefix_cache, **kw)

    def validate(self, request) -> None:
        check_request(request, self.vocab_size)
        if request.draft and not self.has_mtp:
            raise ValueError(f"model {self.backend.spec.name} has no MTP layer to draft with: use draft 0")

    def open(self, lane: LaneState) -> None:
        lane.seq = self.backend.new_sequence()
        lane.private = _Private(Sampler(lane.sampling))
        if lane.constraint is not None:
            lane.private.matcher = lane.constraint.matcher()
        if self.reuse is not None:
            lane.private.tail = self.reuse.restore(lane)

    def prefill(self, lane: LaneState, ids: list[int], last: bool) -> int | None:
        b, priv, start = self.backend, lane.private, lane.length
        logits, hidden = b.prefill(lane.seq, list(ids))
        mtp_start, hidden = self._after_tail(lane, start, hidden)
        if not last:
            if lane.k:           # every next token of a middle chunk is known: the MTP runs over it now
                b.mtp(lane.seq, hidden, lane.prompt[mtp_start + 1:start + len(ids) + 1], mtp_start)
            self._checkpoint(lane, start, last, lambda: MtpTail.of(lane.length - 1, hidden[-1:]))
            return None
        token = choose(lane, logits[-1])
        if lane.k:               # the last slot needs the first token: drafting waits for the first round
            priv.pending = (hidden, lane.prompt[mtp_start + 1:] + [token], mtp_start)
        lane.anchor = token
        self._checkpoint(lane, start, last, lambda: MtpTail.of(mtp_start, hidden))
        return token

    def round(self, lanes: list[LaneState]) -> dict[int, list[int] | BaseException]:
        out: dict[int, list[int] | BaseException] = {}
        plain = [lane for lane in lanes if not lane.k]
        if self.batch_steps and len(plain) > 1:
            out.update(self._batched_steps(plain))
        for lane in lanes:
            if lane.lane in out:
                continue
            try:
                out[lane.lane] = self._speculative(lane) if lane.k else self._step(lane)
            except Exception as err:        # one lane's failure is that lane's alone
                out[lane.lane] = err
        return out

    def release(self, lane: LaneState) -> None:
        if lane.seq is not None and self.reuse is not None:
            pending = lane.private.pending if lane.k else None
            self.reuse.at_release(lane, lambda: MtpTail.of(pending[2], pending[0]) if pending else None)
        if lane.seq is not None:
            self.backend.release(lane.seq)
            lane.seq = None

    def usage(self) -> dict[str, int]:
        slots, blocks = self.backend.slots, self.backend.blocks
        return {"slots": slots.num_slots, "slots_in_use": slots.num_slots - slots.free_slots,
                "pages": blocks.num_pages, "pages_in_use": blocks.num_pages - blocks.free_pages,
                **(self.backend.prefix.usage() if self.backend.prefix is not None else {})}

    # ------------------------------------------------------------ prefix reuse (engine.reuse)
    @staticmethod
    def _after_tail(lane: LaneState, start: int, hidden: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(first MTP slot, hidden rows from it): a restored prefix's pending MTP rows come first."""
        tail, lane.private.tail = lane.private.tail, None
        if tail is None or not lane.k:
            return start, hidden
        return tail.start, torch.cat([tail.hidden, hidden])

    def _checkpoint(self, lane: LaneState, start: int, last: bool, tail) -> None:
        """After a prefill chunk: a checkpoint at the prompt's end or a `checkpoint_every` boundary; `tail()`
        makes the MTP's pending input (a lane with drafts)."""
        if self.reuse is not None and self.reuse.wants(start, lane.length, last):
            self.reuse.after_chunk(lane, tail() if lane.k else None)

    # ------------------------------------------------------------ one lane's round
    def _step(self, lane: LaneState) -> list[int]:
        logits, _ = self.backend.run("step", [lane.seq], [[lane.anchor]])
        lane.anchor = choose(lane, logits[-1])
        return [lane.anchor]

    def _batched_steps(self, lanes: list[LaneState]) -> dict[int, list[int] | BaseException]:
        try:
            logits, _ = self.backend.run("step", [lane.seq for lane in lanes], [[lane.anchor] for lane in lanes])
        except Exception as err:
            return {lane.lane: err for lane in lanes}
        rows = logits.reshape(len(lanes), -1, logits.shape[-1])[:, -1]
        out: dict[int, list[int] | BaseException] = {}
        for lane, row in zip(lanes, rows):
            try:
                lane.anchor = choose(lane, row)
                out[lane.lane] = [lane.anchor]
            except Exception as err:        # a grammar that failed: that lane's alone
                out[lane.lane] = err
        return out

    def _speculative(self, lane: LaneState) -> list[int]:
        """speculative.speculative_stream's round for one lane, drafting at the start of the round (no
        MTP work for a lane that finishes) and with fewer drafts where the context ends."""
        b, priv, seq, params = self.backend, lane.private, lane.seq, lane.sampling
        k = max(0, min(lane.k, lane.max_context - seq.length - 1))        # verify L..L+k must fit
        if priv.pending is not None:
            hidden, next_ids, start = priv.pending
            priv.pending = None
            lane.drafts, priv.draft_probs = (Drafter(b, params, k, priv.sampler.gen).propose(seq, hidden, next_ids, start)
                                             if k else ([], None))
        drafts = lane.drafts[:k]
        start = seq.length
        v_logits, v_hidden = b.verify(seq, [lane.anchor] + drafts)
        if priv.matcher is not None:
            v_logits = masked_verify(priv.matcher, drafts, v_logits)
        if params.greedy:
            out = accept_greedy(drafts, v_logits)
        else:
            probs = priv.draft_probs[:k] if drafts else None
            out = accept_sampled(drafts, probs, distribution(v_logits, params), priv.sampler.gen)
        lane.stats.drafted += len(drafts)
        lane.stats.accepted += len(out) - 1
        out = truncate(out, lane.stop, lane.budget)
        if priv.matcher is not None:
            priv.matcher.consume_all(out)
        b.commit(seq, len(out))
        priv.pending = (v_hidden[:len(out)], out, start)
        lane.anchor = out[-1]
        return out


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
