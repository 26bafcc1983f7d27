"""reference: `ReferenceLanes`, the LaneBackend (lanes.contract) over the reference interpreter's backend
(ninfer_gen.reference): every lane's round runs host-side with ninfer_gen.speculative's math, B = 1 calls
per lane, so a lane's tokens are bit-identical alone or in any cohort. Any K ≥ 0 per request. A request with
images: the encoder (ReferenceBackend.encode) at its first chunk with image tokens, each chunk's image tokens and
the sequence's M-RoPE positions (compiler.multimodal.RopePositions) through prefill, steps, verify and the MTP."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


from ninfer_gen.lanes.contract import Capabilities, LaneBackend, LaneState, check_request, choose, masked_verify
from ninfer_gen.lanes.images import check_images, chunk_images, open_images
from ninfer_gen.lanes.reuse import MtpTail, PrefixReuse
from ninfer_gen.sampling import Sampler, distribution
from ninfer_gen.speculative import Drafter, accept_greedy, accept_sampled, truncate

MAX_DRAFT = 16          # the reference drafts any K; past this a round verifies more than it can keep


@dataclass
class _Private:
    sampler: Sampler                   # seeded from the request's seed; its generator also draws drafts
    pending: tuple | None = None       # (hidden rows, next ids, start): the MTP input of the next drafts
    draft_probs: torch.Tensor | None = None
    matcher: Any = None                # the grammar's state after the lane's output (engine.grammar.Matcher)
    tail: MtpTail | None = None        # a restored prefix's MTP input, run with the first prefill chunk
    images: torch.Tensor | None = None  # the encoder's image tokens of the request's images (prefill only)


class ReferenceLanes(LaneBackend):
    """LaneBackend over a ReferenceBackend. Each lane's round is its own B = 1 calls (verify → commit
    per lane: the reference keeps one ReplaySSM record buffer per verify shape), so a lane's tokens are
    bit-identical to the same request run alone. `batch_steps=True` runs the K = 0 lanes of a round as
    one B-row step instead — faster on the CPU, but its rows agree with B = 1 only to fp32 rounding
    (CPU matmuls are not batch-invariant), so a greedy token may flip at a near-tie."""

    def __init__(self, backend, *, batch_steps: bool = False, prefix_cache: int = 0, checkpoint_every: int = 4096):
        """`prefix_cache`: checkpoints kept for prefix reuse (lanes.reuse; 0: none), one every
        `checkpoint_every` tokens of a long prompt."""
        self.backend, self.batch_steps = backend, batch_steps
        self.reuse = PrefixReuse(backend, prefix_cache, checkpoint_every) if prefix_cache else None
        self.vocab_size = backend.spec.model.vocab_size
        self.has_mtp = bool(backend.spec.model.mtp.num_layers)
        self.caps = Capabilities(lanes=backend.slots.num_slots, max_context=backend.max_context,
                                 prefill_chunk=backend.spec.runtime.prefill_chunk,
                                 max_draft=MAX_DRAFT if self.has_mtp else 0, prefix_cache=prefix_cache)

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
        check_images(request, self.backend.spec.vision, "visual.pos_embed.weight" in self.backend.weights)
        if request.draft and not self.has_mtp:
            raise ValueError(f"model {self.backend.spec.name} has no MTP layer to draft with: use draft 0")
        self.check_draft(request)

    def open(self, lane: LaneState) -> None:
        lane.seq = self.backend.new_sequence()
        lane.private = _Private(Sampler(lane.sampling))
        open_images(lane, self.backend.spec.vision)
        if lane.constraint is not None:
            lane.private.matcher = lane.constraint.matcher()
        if self.reuse is not None:
            lane.private.tail = self.reuse.restore(lane)

    def prefill(self, lane: LaneState, ids: list[int], last: bool) -> int | None:
        b, priv, start = self.backend, lane.private, lane.length
        logits, hidden = b.prefill(lane.seq, list(ids), images=chunk_images(lane, start, ids, b.spec.vision, b.encode))
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
        return self.backend.usage()

    # ------------------------------------------------------------ prefix reuse (lanes.reuse)
    @staticmethod
    def _after_tail(lane: LaneState, start: int, hidden: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(first MTP slot, hidden rows from it): a restored prefix's pending MTP rows come first."""
        tail, lane.private.tail = lane.private.tail, None
        if tail is None or not lane.k:
            return start, hidden
        return tail.start, torch.cat([tail.hidden, hidden])

    def _checkpoint(self, lane: LaneState, start: int, last: bool, tail) -> None:
        if self.reuse is not None:
            self.reuse.after_chunk(lane, start, last, tail)

    # ------------------------------------------------------------ one lane's round
    def _step(self, lane: LaneState) -> list[int]:
        logits, _ = self.backend.run("step", [lane.seq], [[lane.anchor]])
        lane.stats.rounds += 1
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
            lane.stats.rounds += 1
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
        lane.stats.rounds += 1
        lane.stats.drafted += len(drafts)
        lane.stats.accepted += len(out) - 1
        out = truncate(out, lane.stop, lane.budget)
        if priv.matcher is not None:
            priv.matcher.consume_all(out)
        b.commit(seq, len(out))
        priv.pending = (v_hidden[:len(out)], out, start)
        lane.anchor = out[-1]
        return out
