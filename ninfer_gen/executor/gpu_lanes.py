"""gpu_lanes: the cohort engine's LaneBackend on the GPU (engine.lanes states the contract) — up to C lanes
of one GpuBackend decoding together.

Per engine round: every speculative lane runs in ONE round graph (compiler.round) of the smallest compiled
cohort bucket that holds them — its other rows IDLE, i.e. padded everywhere (slot −1, no keys, trash-page
KV writes), so they touch no state — and the plain (K = 0) lanes in one padded step bucket. A lane keeps
its row from round to round while the bucket stays the same; when the bucket changes (lanes joined or
left across a cohort size), the last round's pending fold (fused mode: the accepted records are folded at
the start of the next round) runs eagerly first and the rows are compacted, so a fold always reads the
ReplaySSM records of the rows that logged them (executor.round_rows keeps that bookkeeping).

The host keeps each speculative lane's round-state row (spec_round.ROUND_FIELDS: length, anchor, drafts,
budget, stop tokens, sampling parameters, RNG counter) as a mirror: before a round the rows of the bucket
are written from the mirrors (the budget the engine gives this round, RUNNING), after it they are read
back — one host→device and one device→host copy of a few hundred bytes per lane, and the round's tokens.
Numbers: a lane's greedy tokens do not depend on the other rows (the kernels are batch-invariant: their
reduction order never follows the rows), so a request's greedy output is the same alone or in any cohort.

Prefill runs per lane on the B = 1 prefill buckets, one engine chunk at a time; with drafts, the MTP runs
over each chunk as it goes and the last chunk's first drafts come from engine.speculative.Drafter. A lane
whose context has no room for one more round (verify K+1 positions and chain K−1 drafts) continues with
plain steps. Every bucket and round graph is captured when the adapter is made, not at request time.

Structured output (a grammar, engine.grammar): its mask depends on every token before, so a constrained lane
runs host-driven rounds — the B = 1 verify, its rows masked on the device by the grammar's state after each
draft (engine.lanes.masked_verify), acceptance, commit, then the next drafts — and masked plain steps. A
host round reuses the ReplaySSM record rows, so the device rounds' pending fold is folded first.
The adapter uses the round-state rows of the backend's DeviceRounds: do not stream through both at once.

Prefix reuse (engine.reuse, as ReferenceLanes): checkpoints at prompt ends, chunk boundaries and normal
answer ends, restored at `open`; the saved GDN states live in device memory, bounded by the backend's
memory plan (`prefix_states`). A device round runs the MTP over every slot it commits, so an answer's
checkpoint has no pending MTP rows (an empty tail) unless the lane finished with plain steps (none); a
lane's pending fold is folded before its answer is saved.
"""
from __future__ import annotations

import torch

from compiler.kernels import spec_round as sr
from ninfer_gen.engine.lanes import LaneState, check_request, choose, masked_verify
from ninfer_gen.engine.reuse import MtpTail, PrefixReuse
from ninfer_gen.engine.sampling import Sampler, distribution
from ninfer_gen.engine.speculative import Drafter, accept_greedy, accept_sampled, truncate
from ninfer_gen.executor.device_rounds import _F, idle_rows, round_row
from ninfer_gen.executor.round_rows import RoundRows

ACCEPTANCE_OF = {True: "greedy", False: "sampled"}


class _Lane:
    """The adapter's data of one lane (LaneState.private)."""

    def __init__(self, lane: LaneState):
        self.sampler = Sampler(lane.sampling)            # the first token and plain steps (host RNG)
        self.seed = lane.sampling.seed if lane.sampling.seed is not None else 0      # the device rounds' RNG
        self.row: torch.Tensor | None = None             # the round-state mirror; None: plain steps
        self.q: torch.Tensor | None = None               # sampled: the first drafts' distributions [K, V]
        self.pages = -1                                  # block-table pages written to the lane's row
        self.tail: MtpTail | None = None                 # a restored prefix's MTP input, run with the first chunk
        self.last_hidden: torch.Tensor | None = None     # prefix reuse: the last committed slot's hidden row [1, H]
        self.matcher = lane.constraint.matcher() if lane.constraint is not None else None   # engine.grammar
        self.host = False                                # a grammar's speculative rounds: host-driven (below)


class GpuLanes:
    """LaneBackend over a GpuBackend (executor.gpu_backend) built for `capacity` ≥ the engine's lanes.
    `accept_prob` (bench only, a backend built with accept_coin): every draft is kept by a coin of that
    probability instead of by the target (random weights accept nothing)."""

    def __init__(self, backend, *, accept_prob: float | None = None, capture: bool = True,
                 prefix_cache: int | None = None, checkpoint_every: int = 4096):
        """`prefix_cache`: checkpoints kept for prefix reuse (None: the backend's planned `prefix_states`; 0: off)."""
        be = self.be = backend
        self.capacity = be.slots.num_slots
        self.max_context = be.max_context
        self.prefill_chunk = be.profile.prefill_chunk
        self.vocab_size = be.spec.model.vocab_size
        self.k = be.profile.draft if be.profile.speculative else 0
        self.T = self.k + 1
        if accept_prob is not None and not (self.k and be.profile.accept_coin):
            raise ValueError("--accept-prob needs a speculative backend built with accept_coin")
        self.accept_prob = accept_prob
        self.round_sizes = sorted({b for b, _ in be.profile.rounds()})
        self.step_sizes = sorted({b for e, b, t in be.profile.shapes() if e == "step" and t == 1})
        n = be.prefix_states if prefix_cache is None else prefix_cache
        if n > be.prefix_states:
            raise ValueError(f"a prefix cache of {n} checkpoints needs their GDN states in the memory plan: load the "
                             f"model with prefix_states={n} (it has {be.prefix_states})")
        self.reuse = PrefixReuse(be, n, checkpoint_every) if n else None      # n states: the plan's
        self.rows = RoundRows(be) if self.k else None     # which lane is in which row; the pending fold
        if capture:
            self.capture()

    @classmethod
    def for_model(cls, model, lanes: int, **kw) -> "GpuLanes":
        """Lanes over a loaded GPU Model; its backend must hold `lanes` sequences (load(..., cohorts=lanes))."""
        from ninfer_gen.executor.gpu_backend import GpuBackend

        b = model.backend
        if not isinstance(b, GpuBackend):
            raise ValueError(f"GpuLanes runs on the GPU backend, not the {type(b).__name__}")
        if b.slots.num_slots < lanes:
            raise ValueError(f"the GPU backend was built for {b.slots.num_slots} lane(s), not {lanes}: load it with "
                             f"cohorts={lanes} (--cohorts {lanes})")
        return cls(b, **kw)

    def capture(self) -> None:
        """Every bucket of the profile and every round graph the adapter may run, captured now (start-up)."""
        be = self.be
        be.capture_profile()
        kinds = ("coin",) if self.accept_prob is not None else ("greedy", "sampled")
        for b in self.round_sizes:
            for acceptance in kinds:
                self._round(b, acceptance)
            be.bucket("commit", b, self.T).inputs.set([], [], [], [])      # nothing to fold
        torch.cuda.synchronize(be.device)

    def _round(self, batch: int, acceptance: str):
        rnd = self.be.exe.round(batch, acceptance, fold=True)
        if self.be.use_graphs and rnd.graph is None:
            self.be.exe.capture_round(rnd, lambda: idle_rows(self.be, self.rows.device, batch))
        return rnd

    # ------------------------------------------------------------ the contract
    def validate(self, request) -> None:
        check_request(request, self.vocab_size)
        if request.draft and not self.k:
            raise ValueError(f"this GPU backend has no speculative rounds ({self.be.profile.describe()}): use draft 0")
        if request.draft not in (0, self.k):
            raise ValueError(f"this GPU backend was built for {self.k} drafts per round: ask for draft {self.k} or 0 "
                             f"(not {request.draft})")
        if request.draft and len(request.stop) > sr.MAX_STOPS:
            raise ValueError(f"at most {sr.MAX_STOPS} stop tokens with drafts on the GPU, got {len(request.stop)}")

    def open(self, lane: LaneState) -> None:
        lane.seq = self.be.new_sequence()
        lane.private = _Lane(lane)
        if self.reuse is not None:
            lane.private.tail = self.reuse.restore(lane)

    def prefill(self, lane: LaneState, ids: list[int], last: bool) -> int | None:
        be, priv, seq, start = self.be, lane.private, lane.seq, lane.length
        logits, hidden = be.prefill(seq, list(ids), all_hidden=bool(lane.k))
        tail, priv.tail = priv.tail, None
        mtp_start = start
        if tail is not None and lane.k:  # a restored prefix's pending MTP rows come first
            mtp_start, hidden = tail.start, torch.cat([tail.hidden.to(hidden.device), hidden])
        if not last:
            if lane.k:           # every next token of a middle chunk is known: the MTP runs over it now
                be.mtp(seq, hidden, lane.prompt[mtp_start + 1:start + len(ids) + 1], mtp_start)
            # the MTP's last slot used the next prompt token, which a prompt restoring this one may not share
            self._checkpoint(lane, start, False, lambda: MtpTail.of(lane.length - 1, hidden[-1:]))
            return None
        token = choose(lane, logits[-1])
        lane.anchor = token
        drafted = bool(lane.k) and self._room_for_round(seq.length)
        if drafted:
            be._reserve(seq, min(seq.length + 2 * self.T, self.max_context))     # the chained drafts' MTP slots
            drafts, priv.q = Drafter(be, lane.sampling, self.k, priv.sampler.gen).propose(
                seq, hidden, lane.prompt[mtp_start + 1:] + [token], mtp_start)
            lane.drafts = drafts
            if priv.matcher is not None:
                priv.host = True
            else:
                priv.row = round_row(seq, token, drafts, 0, lane.sampling, lane.stop, self.accept_prob, priv.seed,
                                     be.state.trash_page)
        # drafting ran the MTP over the chunk, its last slot with this request's first token: only that slot
        # is left for a restoring lane; without drafting the whole chunk is
        self._checkpoint(lane, start, True, lambda: MtpTail.of(lane.length - 1, hidden[-1:]) if drafted
                         else MtpTail.of(mtp_start, hidden))
        return token

    def round(self, lanes: list[LaneState]) -> dict[int, list[int] | BaseException]:
        out: dict[int, list[int] | BaseException] = {}
        for lane in lanes:
            if not self._room_for_round(lane.length):    # no room for K+1 more positions: plain steps from here
                if lane.private.row is not None:
                    self._leave_rounds(lane)
                lane.private.host = False
        hosted = [lane for lane in lanes if lane.private.host]
        if hosted:
            self.rows.flush()                            # host rounds reuse the record rows
            for lane in hosted:
                try:
                    out[lane.lane] = self._host_round(lane)
                except Exception as err:                 # a grammar or a round that failed: that lane's alone
                    out[lane.lane] = err
        speculative = [lane for lane in lanes if lane.private.row is not None]
        plain = [lane for lane in lanes if lane.private.row is None and not lane.private.host]
        for group, run in ((speculative, self._speculative), (plain, self._steps)):
            if group:
                try:
                    out.update(run(group))
                except Exception as err:                 # the call failed: every lane of it fails
                    out.update({lane.lane: err for lane in group if lane.lane not in out})
        return out

    def release(self, lane: LaneState) -> None:
        if lane.seq is not None and self.reuse is not None:
            if self.rows is not None:
                self.rows.fold(lane)                     # the last round's accepted tokens into the state first
            # rounds ran the MTP over every committed slot, the last with the lane's last token (which a
            # restoring prompt may not share): that slot is left; plain steps at the context end ran none
            running = lane.private.row is not None or lane.private.host
            last = lane.private.last_hidden if lane.k and running else None
            self.reuse.at_release(lane, lambda: MtpTail.of(lane.length - 1, last) if last is not None else None)
        if self.rows is not None:
            self.rows.vacate(lane)
        if lane.seq is not None:
            self.be.release(lane.seq)
            lane.seq = None

    def usage(self) -> dict[str, int]:
        slots, blocks = self.be.slots, self.be.blocks
        return {"slots": slots.num_slots, "slots_in_use": slots.num_slots - slots.free_slots,
                "pages": blocks.num_pages, "pages_in_use": blocks.num_pages - blocks.free_pages,
                **(self.be.prefix.usage() if self.be.prefix is not None else {})}

    # ------------------------------------------------------------ prefix reuse (engine.reuse)
    def _checkpoint(self, lane: LaneState, start: int, last: bool, tail) -> None:
        """After a prefill chunk: a checkpoint at the prompt's end or a `checkpoint_every` boundary; `tail()`
        makes the MTP's pending input (a lane with drafts)."""
        if self.reuse is not None and self.reuse.wants(start, lane.length, last):
            self.reuse.after_chunk(lane, tail() if lane.k else None)

    # ------------------------------------------------------------ speculative rounds
    def _room_for_round(self, length: int) -> bool:
        """A round verifies L..L+K and chains drafts up to L' + K − 2 (L' ≤ L + K + 1): all in the context."""
        return length + 2 * self.T - 2 <= self.max_context

    def _speculative(self, lanes: list[LaneState]) -> dict[int, list[int] | BaseException]:
        be, T = self.be, self.T
        out: dict[int, list[int] | BaseException] = {}
        ready = []
        for lane in lanes:                               # this round's pages first: a lane that cannot grow fails alone
            try:
                be._reserve(lane.seq, min(lane.length + 2 * T, self.max_context))
                ready.append(lane)
            except Exception as err:
                out[lane.lane] = err
        if not ready:
            return out
        batch = next(b for b in self.round_sizes if b >= len(ready))
        rows = self.rows
        rows.place(ready, batch)
        coin = self.accept_prob is not None
        acceptance = "coin" if coin else ACCEPTANCE_OF[all(lane.sampling.greedy for lane in ready)]
        back = rows.run(self._round(batch, acceptance))
        if self.reuse is not None:                       # the MTP pass's input rows, padded with the last committed
            hidden = be.bucket("mtp", batch, T).inputs.tensors["hidden"].view(batch, T, -1)[:, T - 1].clone()
        for r, lane in enumerate(rows.layout):
            if lane is None:
                continue
            h = back[r].clone()
            n = int(h[_F["emitted"]])
            tokens = h[sr.OUT_AT:sr.OUT_AT + n].tolist()
            lane.private.row = h
            if self.reuse is not None:
                lane.private.last_hidden = hidden[r:r + 1]
            lane.seq.table.length = int(h[_F["length"]])
            lane.anchor = tokens[-1] if tokens else lane.anchor
            lane.drafts = h[sr.DRAFTS_AT:sr.DRAFTS_AT + self.k].tolist()
            lane.stats.drafted += self.k
            lane.stats.accepted += int(h[_F["accepted"]])
            out[lane.lane] = tokens if tokens else RuntimeError(f"the round emitted nothing for lane {lane.lane}")
        return out

    def _leave_rounds(self, lane: LaneState) -> None:
        """The lane continues with plain steps: its pending fold is folded first."""
        self.rows.leave(lane)
        lane.private.row = None
        lane.private.q = None
        lane.drafts = []

    # ------------------------------------------------------------ a grammar's rounds
    def _host_round(self, lane: LaneState) -> list[int]:
        """One constrained lane's round, host-driven (engine.speculative's math on the B = 1 buckets): verify
        [anchor, drafts] with each row masked by the grammar, accept, truncate, commit, draft the next round."""
        be, priv, seq, params = self.be, lane.private, lane.seq, lane.sampling
        drafts, start = lane.drafts, lane.length
        v_logits, v_hidden = be.verify(seq, [lane.anchor] + drafts)
        v_logits = masked_verify(priv.matcher, drafts, v_logits)
        if params.greedy:
            out = accept_greedy(drafts, v_logits)
        else:
            out = accept_sampled(drafts, priv.q, distribution(v_logits, params), priv.sampler.gen)
        lane.stats.drafted += len(drafts)
        lane.stats.accepted += len(out) - 1
        out = truncate(out, lane.stop, lane.budget)
        priv.matcher.consume_all(out)
        be.commit(seq, len(out))
        lane.anchor = out[-1]
        priv.last_hidden = v_hidden[len(out) - 1:len(out)].clone()
        if self._room_for_round(seq.length):          # the next round's drafts (the MTP over the committed slots)
            be._reserve(seq, min(seq.length + 2 * self.T, self.max_context))
            lane.drafts, priv.q = Drafter(be, params, self.k, priv.sampler.gen).propose(
                seq, v_hidden[:len(out)], out, start)
        return out

    # ------------------------------------------------------------ plain steps
    def _steps(self, lanes: list[LaneState]) -> dict[int, list[int] | BaseException]:
        """One token for every K = 0 lane, in one padded step bucket."""
        be = self.be
        batch = next((b for b in self.step_sizes if b >= len(lanes)), None)
        if batch is None:                                # more plain lanes than the largest step bucket
            half = self.step_sizes[-1]
            return {**self._steps(lanes[:half]), **self._steps(lanes[half:])}
        for lane in lanes:
            be._reserve(lane.seq, lane.length + 1)
        bucket = be.bucket("step", batch, 1)
        bucket.inputs.set([[lane.anchor] for lane in lanes], [lane.length for lane in lanes],
                          [lane.seq.table.pages for lane in lanes], [lane.slot for lane in lanes])
        bucket.run(be.use_graphs)
        logits = bucket.logits.view(batch, -1)[:len(lanes)]
        free = [lane.sampling.greedy and lane.private.matcher is None for lane in lanes]
        best = logits.argmax(-1).tolist() if any(free) else None
        out: dict[int, list[int] | BaseException] = {}
        for r, lane in enumerate(lanes):
            lane.seq.table.length += 1
            try:
                lane.anchor = best[r] if free[r] else choose(lane, logits[r])
                out[lane.lane] = [lane.anchor]
            except Exception as err:                     # a grammar that failed: that lane's alone
                out[lane.lane] = err
        return out
