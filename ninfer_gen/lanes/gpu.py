"""gpu: the cohort engine's LaneBackend on the GPU (lanes.contract states the contract) — up to C lanes of one
GpuBackend decoding together; the one driver of the GPU's speculative rounds.

Per engine round the speculative lanes run in ONE round graph (compiler.round) of the smallest cohort bucket
that holds them (more lanes than the largest bucket: several rounds); its other rows are IDLE (padded
everywhere: slot −1, no keys, trash-page KV writes). Plain (K = 0) lanes run in one padded step bucket. A lane
keeps its row while the bucket's lanes stay; the host launches the next round before it reads the last one back
(`depth` rounds in flight). When the lanes change, the rounds in flight are collected, the pending fold (the
accepted records, folded at the next round's start — or inside its verify: CompileOptions.fold_in_verify) runs
eagerly and the rows are rewritten from the host's mirrors (lanes.round_rows). A lane's own K ≤ the built K is
its row's `k`. The kernels are batch-invariant: a request's greedy output is the same alone or in any cohort.

Prefill takes every chunk of an engine step in one call (`prefill_many`): the lanes' prompt pieces of one shape
run together (their prefill pieces on the B = 1 buckets, their tail steps as (B, 4) and (B, 1) steps; a piece with
images alone: lanes.images); with drafts the MTP runs over each chunk and the last chunk's drafts come from
ninfer_gen.speculative.draft_together, the lanes' MTP passes and chained drafts batched the same way
(lanes.gpu_prompt). A lane
without room for one more round continues with plain steps. Every graph is captured when the adapter is made.
A constrained lane (engine.grammar) runs host-driven rounds on the B = 1 buckets, its verify rows masked by the
grammar (lanes.contract.masked_verify), after the device rounds' pending fold. Prefix reuse (lanes.reuse):
checkpoints at prompt ends, chunk boundaries and normal answer ends; the saved GDN states are device memory in
the backend's plan (`prefix_states`).
"""
from __future__ import annotations

import dataclasses

import torch

from compiler.kernels import spec_round as sr
from ninfer_gen.lanes.contract import Capabilities, LaneBackend, LaneState, check_request, choose, masked_verify
from ninfer_gen.lanes.gpu_prompt import run_chunks
from ninfer_gen.lanes.images import check_images, open_images
from ninfer_gen.lanes.reuse import MtpTail, PrefixReuse
from ninfer_gen.lanes.round_costs import measure_round_costs
from ninfer_gen.lanes.round_rows import FIELD, RoundRows, idle_rows
from ninfer_gen.sampling import Sampler, distribution
from ninfer_gen.speculative import Drafter, accept_greedy, accept_sampled, truncate

ROUND_MODES = ("fused", "eager")
ACCEPTANCE_OF = {True: "greedy", False: "sampled"}    # all lanes greedy → the round graph kind


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
        self.k = lane.k                                  # drafts its rounds may keep (≤ the built K)
        self.budget = 0                                  # tokens its row may still emit when the rows are written
        self.images: torch.Tensor | None = None          # the tower's image tokens of the request (prefill only)


class GpuLanes(LaneBackend):
    """LaneBackend over a GpuBackend (executor.gpu_backend) built for `capacity` ≥ the engine's lanes.
    `accept_prob` (bench only, a backend built with accept_coin): every draft is kept by a coin of that
    probability instead of by the target (random weights accept nothing)."""

    def __init__(self, backend, *, accept_prob: float | None = None, capture: bool = True,
                 prefix_cache: int | None = None, checkpoint_every: int = 4096, round_mode: str = "fused",
                 in_flight: int = 2):
        """`prefix_cache`: checkpoints kept for prefix reuse (None: the backend's planned `prefix_states`; 0: off).
        `round_mode`: `fused` (the fold is the first step of the next round's graph) or `eager` (the fold runs
        as its own graph after the host read the round; one round in flight) — REPLAYSSM.md compares them.
        `in_flight`: fused rounds queued ahead of the host's read-back."""
        be = self.be = backend
        if round_mode not in ROUND_MODES:
            raise ValueError(f"round mode {round_mode!r}: expected one of {', '.join(ROUND_MODES)}")
        if in_flight < 1:
            raise ValueError(f"in_flight must be ≥ 1 round, got {in_flight}")
        self.round_mode = round_mode
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
        depth = 1 if round_mode == "eager" else in_flight
        self.rows = RoundRows(be, depth, round_mode == "fused") if self.k else None     # rows; rounds in flight
        self.caps = Capabilities(lanes=be.slots.num_slots, max_context=be.max_context,
                                 prefill_chunk=be.profile.prefill_chunk, max_draft=self.k,
                                 cohort_sizes=tuple(self.round_sizes), rounds_in_flight=depth if self.k else 1,
                                 prefix_cache=n)
        self._out: dict[int, list[int]] = {}             # tokens collected by a drain, not yet returned
        if capture:
            self.capture()
            if self.k and be.use_graphs:
                self.caps = dataclasses.replace(self.caps, round_cost=measure_round_costs(self))

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
        parities = (0, 1) if self.rows is not None and self.rows.in_verify else (0,)
        for b in self.round_sizes:
            for acceptance in kinds:
                for parity in parities:
                    self.round_graph(b, acceptance, parity)
            be.bucket("commit", b, self.T).inputs.set([], [], [], [])      # nothing to fold
        torch.cuda.synchronize(be.device)

    def round_graph(self, batch: int, acceptance: str, parity: int = 0):
        """The `batch`-lane round graph of an acceptance kind (and record set, when the rounds fold inside the
        next verify: round_rows), captured on first use."""
        rnd = self.be.exe.round(batch, acceptance, fold=self.round_mode == "fused", parity=parity)
        if self.be.use_graphs and rnd.graph is None:
            self.be.exe.capture_round(rnd, lambda: idle_rows(self.be, self.rows.device, batch))
        return rnd

    # ------------------------------------------------------------ the contract
    def validate(self, request) -> None:
        check_request(request, self.vocab_size)
        check_images(request, self.be.spec.vision, self.be.encoder is not None)
        self.check_draft(request)
        if request.draft and len(request.stop) > sr.MAX_STOPS:
            raise ValueError(f"at most {sr.MAX_STOPS} stop tokens with drafts on the GPU, got {len(request.stop)}")

    def open(self, lane: LaneState) -> None:
        lane.seq = self.be.new_sequence()
        lane.private = _Lane(lane)
        open_images(lane, self.be.spec.vision)
        if self.reuse is not None:
            lane.private.tail = self.reuse.restore(lane)

    def prefill(self, lane: LaneState, ids: list[int], last: bool) -> int | None:
        out = self.prefill_many([(lane, ids, last)])[lane.lane]
        if isinstance(out, BaseException):
            raise out
        return out

    def prefill_many(self, chunks: list[tuple[LaneState, list[int], bool]]) -> dict[int, int | None | BaseException]:
        """The lanes' chunks together (lanes.gpu_prompt)."""
        return run_chunks(self, chunks)

    def round(self, lanes: list[LaneState]) -> dict[int, list[int] | BaseException]:
        out: dict[int, list[int] | BaseException] = {}
        for lane in lanes:
            if not lane.k or not self._room_for_round(lane.length):   # K dropped to 0 (adaptive), or no room for
                if lane.private.row is not None:                      # K+1 more positions: plain steps from here
                    self._leave_rounds(lane)
                lane.private.host = False
        speculative = [lane for lane in lanes if lane.private.row is not None]
        for lane in lanes:      # tokens a drain collected for a lane that leaves the rounds: they are its round
            if lane.private.row is None and lane.lane in self._out:
                out[lane.lane] = self._out.pop(lane.lane)
        hosted = [lane for lane in lanes if lane.private.host and lane.lane not in out]
        if hosted:
            self._settle()
            self.rows.flush()                            # host rounds reuse the record rows
            for lane in hosted:
                try:
                    out[lane.lane] = self._host_round(lane)
                except Exception as err:                 # a grammar or a round that failed: that lane's alone
                    out[lane.lane] = err
        plain = [lane for lane in lanes if lane.private.row is None and not lane.private.host and lane.lane not in out]
        for group, run in ((speculative, self._speculative), (plain, self._steps)):
            if group:
                try:
                    out.update(run(group))
                except Exception as err:                 # the call failed: every lane of it fails
                    out.update({lane.lane: err for lane in group if lane.lane not in out})
        return out

    def release(self, lane: LaneState) -> None:
        if self.rows is not None and lane in self.rows.layout:
            self._settle()                               # no round in flight may touch the slot after this
        self._out.pop(lane.lane, None)
        if lane.seq is not None and self.reuse is not None:
            if self.rows is not None and lane in self.rows.layout:
                self.rows.flush()                        # the last round's accepted tokens into the state first
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
        return self.be.usage()

    # ------------------------------------------------------------ prefix reuse (lanes.reuse)
    def _checkpoint(self, lane: LaneState, start: int, last: bool, tail) -> None:
        if self.reuse is not None:
            self.reuse.after_chunk(lane, start, last, tail)

    # ------------------------------------------------------------ speculative rounds
    def _room_for_round(self, length: int) -> bool:
        """A round verifies L..L+K and chains drafts up to L' + K − 2 (L' ≤ L + K + 1): all in the context."""
        return length + 2 * self.T - 2 <= self.max_context

    def _speculative(self, lanes: list[LaneState]) -> dict[int, list[int] | BaseException]:
        """Every speculative lane's round: in the smallest round bucket that holds them all, or in several
        rounds of the largest when they are more."""
        biggest = self.round_sizes[-1]
        if len(lanes) <= biggest:
            return self._bucket_round(lanes, next(b for b in self.round_sizes if b >= len(lanes)))
        out: dict[int, list[int] | BaseException] = {}
        for at in range(0, len(lanes), biggest):        # rows change between the groups: no rounds in flight
            out.update(self._bucket_round(lanes[at:at + biggest], biggest))
        return out

    def _bucket_round(self, lanes: list[LaneState], batch: int) -> dict[int, list[int] | BaseException]:
        be, T, rows = self.be, self.T, self.rows
        out: dict[int, list[int] | BaseException] = {}
        if not rows.steady(lanes, batch):
            self._settle()
            ready = []
            for lane in lanes:
                held = self._out.get(lane.lane, [])      # collected, not yet returned: the device counts them
                lane.private.budget = lane.budget - len(held)
                if held and (lane.private.budget <= 0 or held[-1] in lane.stop):
                    out[lane.lane] = self._out.pop(lane.lane)      # the lane ended there: no more rounds
                    continue
                try:                                     # pages first: a lane that cannot grow fails alone
                    be.reserve(lane.seq, min(lane.length + 2 * T, self.max_context))
                    ready.append(lane)
                except Exception as err:
                    out[lane.lane] = err
            if not ready:
                return out
            lanes, batch = ready, next(b for b in self.round_sizes if b >= len(ready))
            rows.place(lanes, batch)
            rows.write()
        acceptance = self._acceptance(lanes)
        self._launch(acceptance, batch, lanes)
        while len(rows.inflight) < rows.depth and self._launch(acceptance, batch, lanes):
            pass
        if self.round_mode == "eager":                   # the fold waits for the host's read of the round
            self._take(rows.collect())
            rows.flush()
        elif rows.inflight:
            self._take(rows.collect())
        for lane in lanes:
            if lane.lane not in out:
                tokens = self._out.pop(lane.lane, None)
                out[lane.lane] = tokens if tokens else RuntimeError(f"the round emitted nothing for lane {lane.lane}")
        return out

    def _acceptance(self, lanes: list[LaneState]) -> str:
        if self.accept_prob is not None:
            return "coin"
        return ACCEPTANCE_OF[all(lane.sampling.greedy for lane in lanes)]

    def _launch(self, acceptance: str, batch: int, lanes: list[LaneState]) -> bool:
        """One more round of the placed lanes, when every lane's context has room for it (its verify and
        chained drafts after the rounds already in flight); its pages are reserved first."""
        rows, T = self.rows, self.T
        ahead = len(rows.inflight) * T                   # committed by the rounds in flight, at most
        if any(lane.length + ahead + 2 * T - 2 > self.max_context for lane in lanes):
            return False
        for lane in lanes:
            self.be.reserve(lane.seq, min(lane.length + ahead + 2 * T, self.max_context))
        rows.tables_changed()
        hidden = None
        if self.reuse is not None:                       # the MTP pass's input rows, padded with the last committed
            hidden = self.be.bucket("mtp", batch, T).inputs.tensors["hidden"].view(batch, T, -1)[:, T - 1]
        rows.launch(self.round_graph(batch, acceptance, rows.parity), hidden)
        return True

    def _take(self, flight) -> None:
        """A collected round's rows into the lanes' mirrors, lengths and stats; its tokens into `_out`."""
        for r, lane in enumerate(flight.layout):
            if lane is None or lane.seq is None:
                continue
            h = flight.rows[r].clone()
            n = int(h[FIELD["emitted"]])
            if n == 0:                                   # launched after the lane finished on the device
                continue
            tokens = h[sr.OUT_AT:sr.OUT_AT + n].tolist()
            lane.private.row = h
            if flight.hidden is not None:
                lane.private.last_hidden = flight.hidden[r:r + 1]
            lane.seq.table.length = int(h[FIELD["length"]])
            lane.anchor = tokens[-1]
            lane.drafts = h[sr.DRAFTS_AT:sr.DRAFTS_AT + self.k].tolist()
            lane.stats.rounds += 1
            lane.stats.drafted += lane.private.k
            lane.stats.accepted += int(h[FIELD["accepted"]])
            self._out.setdefault(lane.lane, []).extend(tokens)

    def _settle(self) -> None:
        """Collect every round in flight (their tokens wait in `_out` for the next call)."""
        if self.rows is not None:
            for flight in self.rows.drain():
                self._take(flight)

    def _leave_rounds(self, lane: LaneState) -> None:
        """The lane continues with plain steps: its pending fold is folded first."""
        self._settle()
        self.rows.leave(lane)
        lane.private.row = None
        lane.private.q = None
        lane.drafts = []

    # ------------------------------------------------------------ a grammar's rounds
    def _host_round(self, lane: LaneState) -> list[int]:
        """One constrained lane's round, host-driven (ninfer_gen.speculative's math on the B = 1 buckets): verify
        [anchor, drafts] with each row masked by the grammar, accept, truncate, commit, draft the next round."""
        be, priv, seq, params = self.be, lane.private, lane.seq, lane.sampling
        start = lane.length
        v_logits, v_hidden = be.verify(seq, [lane.anchor] + lane.drafts)       # the bucket verifies all K
        drafts = lane.drafts[:priv.k]                                          # the lane keeps at most its k
        v_logits = masked_verify(priv.matcher, drafts, v_logits[:len(drafts) + 1])
        if params.greedy:
            out = accept_greedy(drafts, v_logits)
        else:
            out = accept_sampled(drafts, priv.q[:len(drafts)], distribution(v_logits, params), priv.sampler.gen)
        lane.stats.rounds += 1
        lane.stats.drafted += len(drafts)
        lane.stats.accepted += len(out) - 1
        out = truncate(out, lane.stop, lane.budget)
        priv.matcher.consume_all(out)
        be.commit(seq, len(out))
        lane.anchor = out[-1]
        priv.last_hidden = v_hidden[len(out) - 1:len(out)].clone()
        if self._room_for_round(seq.length):          # the next round's drafts (the MTP over the committed slots)
            be.reserve(seq, min(seq.length + 2 * self.T, self.max_context))
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
            be.reserve(lane.seq, lane.length + 1)
        bucket = be.bucket("step", batch, 1)
        bucket.inputs.set([[lane.anchor] for lane in lanes], [lane.length for lane in lanes],
                          [lane.seq.table.pages for lane in lanes], [lane.slot for lane in lanes],
                          [lane.seq.positions for lane in lanes])
        bucket.run(be.use_graphs)
        logits = bucket.logits.view(batch, -1)[:len(lanes)]
        free = [lane.sampling.greedy and lane.private.matcher is None for lane in lanes]
        best = logits.argmax(-1).tolist() if any(free) else None
        out: dict[int, list[int] | BaseException] = {}
        for r, lane in enumerate(lanes):
            lane.seq.table.length += 1
            lane.stats.rounds += 1
            try:
                lane.anchor = best[r] if free[r] else choose(lane, logits[r])
                out[lane.lane] = [lane.anchor]
            except Exception as err:                     # a grammar that failed: that lane's alone
                out[lane.lane] = err
        return out
