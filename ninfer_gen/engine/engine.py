"""engine: the cohort engine — admission (a bounded queue, a clear refusal beyond it), lanes,
the scheduling step, finishing and freeing, events and statistics (what goes in and comes out —
Request, Handle, Event, RequestStats — is engine.requests'). The numbers come from a LaneBackend
(lanes.contract: the contract); this module imports no CUDA and no torch.

A request holds a lane from admission to its end; the lane's sequence (state slot + KV pages) is the
adapter's, released when the request finishes, fails or is cancelled. `step()` is one scheduling
iteration: reap cancelled requests, admit waiting ones into free lanes, run prefill chunks of ≤ `prefill_budget`
prompt tokens in all (lanes whose whole remaining prompt is one chunk first, then the oldest prefilling lane, and
the next while the budget lasts), then one decode round over every decode-ready lane — so a long prompt is cut
across steps and never stalls the running lanes for its whole prefill, a burst of short prompts starts in one step,
and a short prompt (an agent's next turn after a tool call) does not queue behind another request's long prefill.
Drive it by hand (`step`, `run_until_idle`: deterministic, with any `clock`), or in a background
thread (`start`/`stop`) that a server uses: submit and cancel are thread-safe and events arrive on
thread-safe queues. An exception in one request fails that request alone (an `error` event).
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

from ninfer_gen.lanes.contract import LaneBackend, LaneState
from ninfer_gen.engine.draft_policy import DraftPolicy
from ninfer_gen.engine.prefill_policy import PrefillPacer
from ninfer_gen.engine.requests import EngineFull, Event, Handle, Request, RequestStats

@dataclass(eq=False)
class _Live:
    request: Request
    handle: Handle
    order: int
    t_submit: float
    lane: LaneState | None = None
    t_admit: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    cancelled: bool = False
    passed_over: int = 0                # steps in a row its next prompt chunk did not run (Engine._prefill)


# A prefilling lane passed over this many steps in a row goes first: short prompts arriving every step cannot
# starve a long one (each delays it one step at most, and never more than this many in a row).
STARVE_STEPS = 4


class Engine:
    """`lanes` requests run at once (≤ the backend's state slots); `max_queue` more may wait for a lane;
    `prefill_budget` prompt tokens run per step (default: the backend's prefill chunk); `clock` stamps
    the per-request statistics (a fake one makes them deterministic); `adaptive_draft`: a lane whose drafts do
    not pay for their rounds (engine.draft_policy, on the backend's measured round costs) drops to plain steps;
    `max_gap_s`: while lanes decode, a step prefills only as many prompt tokens as keep a decoding lane's gap
    between tokens under it (engine.prefill_policy, from the step times `clock` measures; at most the budget)."""

    def __init__(self, backend: LaneBackend, *, lanes: int = 8, max_queue: int = 64, prefill_budget: int | None = None,
                 clock=time.monotonic, adaptive_draft: bool = False, max_gap_s: float | None = None):
        if not 1 <= lanes <= backend.capacity:
            raise ValueError(f"lanes must be between 1 and the backend's {backend.capacity} state slots, got {lanes}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be ≥ 0, got {max_queue}")
        self.prefill_budget = prefill_budget or backend.prefill_chunk
        if self.prefill_budget < 1:
            raise ValueError(f"prefill_budget must be ≥ 1 token, got {prefill_budget}")
        self.backend, self.max_queue, self.clock = backend, max_queue, clock
        costs = dict(backend.caps.round_cost)
        self.policy = DraftPolicy(costs) if adaptive_draft and costs else None
        self.pacer = (PrefillPacer(max_gap_s, self.prefill_budget, min(16, self.prefill_budget))
                      if max_gap_s is not None else None)
        self._lanes: list[_Live | None] = [None] * lanes
        self._waiting: deque[_Live] = deque()
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()          # waiting, live, cancel flags, counters
        self._wake = threading.Condition(self._lock)
        self._step_lock = threading.Lock()      # one step at a time: the adapter is never called concurrently
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._count = Counter()                 # requests, tokens, prefill tokens, rounds, lane rounds, drafted, accepted
        self._finished = Counter()

    # ------------------------------------------------------------ the public face
    @property
    def lanes(self) -> int:
        return len(self._lanes)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request: Request) -> Handle:
        """Queue a request; EngineFull when `lanes` + `max_queue` requests are in the engine already; a
        ValueError names what the backend cannot run (both before anything is held)."""
        self.backend.validate(request)
        with self._lock:
            rid = request.id if request.id is not None else f"r{next(self._ids)}"
            if rid in self._live:
                raise ValueError(f"request id {rid!r} is already in the engine")
            if len(self._live) >= self.lanes + self.max_queue:       # every lane busy or promised, the queue full
                raise EngineFull(f"engine full: {len(self._live)} requests in the engine, the most it takes "
                                 f"({self.lanes} lanes + max_queue={self.max_queue}); retry later")
            live = _Live(request, Handle(self, rid), self._count["requests"], self.clock())
            self._count["requests"] += 1
            self._live[rid] = live
            self._waiting.append(live)
            self._wake.notify_all()
        return live.handle

    def cancel(self, request_id: str) -> bool:
        """Ends a request with `cancelled` (its lane and sequence are freed now when no step runs, else at the
        start of the next step). False when no such request is in the engine."""
        with self._lock:
            live = self._live.get(request_id)
            if live is None:
                return False
            live.cancelled = True
            if live.lane is None:
                self._waiting.remove(live)
                self._finish(live, "cancelled")
            self._wake.notify_all()
        if self._step_lock.acquire(blocking=False):
            try:
                self._reap()
            finally:
                self._step_lock.release()
        return True

    def stats(self) -> dict:
        with self._lock:
            c = self._count
            return {"lanes": self.lanes, "lanes_busy": sum(live is not None for live in self._lanes),
                    "queue_depth": len(self._waiting), "max_queue": self.max_queue, "requests": c["requests"],
                    "finished": dict(self._finished), "tokens": c["tokens"], "prefill_tokens": c["prefill_tokens"],
                    "prefix_hit_tokens": c["prefix_hit_tokens"],
                    "rounds": c["rounds"], "lane_rounds": c["lane_rounds"], "drafted": c["drafted"],
                    "accepted": c["accepted"], "acceptance": c["accepted"] / c["drafted"] if c["drafted"] else 0.0,
                    "lane_rounds_by_k": {int(name[1:]): n for name, n in sorted(c.items()) if name[:1] == "k"},
                    **self.backend.usage()}

    # ------------------------------------------------------------ scheduling
    def step(self) -> bool:
        """One scheduling iteration; False when there was nothing to do."""
        with self._step_lock:
            worked = self._reap()
            worked |= self._admit()
            worked |= self._prefill()
            ready = [live for live in self._lanes if live is not None and live.lane.anchor is not None]
            if ready:
                self._round(ready)
            return worked or bool(ready)

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def start(self) -> None:
        """Runs steps in a background thread until `stop()`; it sleeps while there is no work."""
        if self.running:
            raise RuntimeError("the engine loop is already running")
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="ninfer-engine", daemon=True)
        self._thread.start()

    def stop(self, cancel: bool = True) -> None:
        """Ends the background loop after its current step; `cancel` also ends every request still in the
        engine (else they wait for the next `step` or `start`)."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if cancel:
            for rid in list(self._live):
                self.cancel(rid)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._live:
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as err:             # a bug of the engine's own: fail what runs, keep serving
                with self._step_lock:
                    for live in list(self._live.values()):
                        self._fail(live, err)

    # ------------------------------------------------------------ a step's parts
    def _reap(self) -> bool:
        with self._lock:
            gone = [live for live in self._lanes if live is not None and live.cancelled]
            for live in gone:
                self._finish(live, "cancelled")
        return bool(gone)

    def _admit(self) -> bool:
        admitted = False
        with self._lock:
            for i, holder in enumerate(self._lanes):
                while holder is None and self._waiting:
                    live, admitted = self._waiting.popleft(), True
                    req = live.request
                    limit = min(req.max_context or self.backend.max_context, self.backend.max_context)
                    live.lane = LaneState(i, list(req.prompt), req.sampling, req.stop, req.draft, limit,
                                          constraint=req.constraint, images=req.images)
                    live.t_admit = self.clock()
                    if len(req.prompt) > limit:
                        self._finish(live, "error", f"the prompt of {len(req.prompt)} tokens exceeds the context "
                                                    f"limit of {limit} tokens")
                        continue
                    self._lanes[i] = holder = live
                    try:
                        self.backend.open(live.lane)
                    except Exception as err:
                        self._fail(live, err)
                        holder = None
                        continue
                    self._count["prefix_hit_tokens"] += live.lane.cached
        return admitted

    def _prefill(self) -> bool:
        """Prefill chunks of the prefilling lanes while the step's budget of prompt tokens lasts, in one backend call
        (`prefill_many`: a backend may run them together): a burst of short prompts starts together (eight
        30-token prompts under the bench's 304-token budget: one step, where one lane per step kept the last lane's
        first token behind seven rounds), and a long prompt is still cut across steps.

        Order: lanes passed over `STARVE_STEPS` steps in a row, then lanes whose whole remaining prompt is one chunk,
        then the oldest. A short prompt therefore never waits behind another request's long prefill — session 18's
        27B agent bench (4 sessions, 32K context): a next turn of ~200 tokens arriving during another session's
        32K prefill waited for all its 4,096-token chunks, 5.95 s at p99 against a p50 of 175 ms — and costs the
        long prompt one step (its chunk no longer fits the rest of the budget); long prompts keep their order.

        A lane's chunks are its prompt cut every `prefill_budget` tokens from where its prefill starts, whatever
        the other lanes take: the step runs a lane's next chunk whole or not at all (the first chunk of a step
        always runs). Chunk boundaries set the prefill's pieces and so its rounding (the GDN's chunked recurrence
        above all), so a request's logits are the bits it gets alone — the same greedy tokens and, for a sampled
        request, the same draws (session 17: a sampled request cut 16 + 64 + 10 beside 7 lanes instead of 64 + 26
        alone drew other tokens from its fourth on). With `max_gap_s` the pacer sizes each step's prefill from
        measured times, so the chunks — and a sampled request's draws — follow the timing."""
        pending = sorted((live for live in self._lanes if live is not None and live.lane.anchor is None),
                         key=lambda x: (x.passed_over < STARVE_STEPS,
                                        len(x.lane.prompt) - x.lane.prefilled > self.prefill_budget, x.order))
        if not pending:
            return False
        budget = self.prefill_budget
        if self.pacer is not None:
            budget = self.pacer.budget(any(x is not None and x.lane.anchor is not None for x in self._lanes))
        chunks = []
        for live in pending:
            if budget <= 0:
                break
            lane = live.lane
            if self.pacer is None:               # the lane's own next chunk, whole: cut as it is alone
                ids = lane.prompt[lane.prefilled:lane.prefilled + self.prefill_budget]
                if chunks and len(ids) > budget:
                    continue                     # it waits for a step with room; a smaller chunk may fit
            else:
                ids = lane.prompt[lane.prefilled:lane.prefilled + budget]
            chunks.append((live, ids, lane.prefilled + len(ids) == len(lane.prompt)))
            budget -= len(ids)
        running = {id(live) for live, _, _ in chunks}
        for live in pending:
            live.passed_over = 0 if id(live) in running else live.passed_over + 1
        t0 = self.clock()
        try:
            results = self.backend.prefill_many([(live.lane, ids, last) for live, ids, last in chunks])
        except Exception as err:                 # the call itself failed: every chunk's lane fails
            results = {live.lane.lane: err for live, _, _ in chunks}
        if self.pacer is not None:
            self.pacer.prefilled(sum(len(ids) for _, ids, _ in chunks), self.clock() - t0)
        for live, ids, last in chunks:
            token = results.get(live.lane.lane, RuntimeError(f"the backend's prefill gave nothing for lane "
                                                             f"{live.lane.lane}"))
            if last and not isinstance(token, (int, BaseException)):
                token = RuntimeError(f"the backend's prefill returned {token!r}, not the first token")
            if isinstance(token, BaseException):
                self._fail(live, token)
                continue
            live.lane.prefilled += len(ids)
            with self._lock:
                self._count["prefill_tokens"] += len(ids)
            if last:
                self._emit(live, [token])
        return True

    def _round(self, ready: list[_Live]) -> None:
        for live in ready:
            live.lane.budget = min(live.request.max_tokens - len(live.lane.tokens), live.lane.room)
        if self.policy is not None:
            self._choose_drafts([live.lane for live in ready])
        with self._lock:
            for live in ready:
                self._count[f"k{live.lane.k}"] += 1
        before = {live: (live.lane.stats.drafted, live.lane.stats.accepted) for live in ready}
        t0 = self.clock()
        try:
            results = self.backend.round([live.lane for live in ready])
        except Exception as err:
            results = {live.lane.lane: err for live in ready}
        if self.pacer is not None:
            self.pacer.rounded(self.clock() - t0)
        with self._lock:
            self._count["rounds"] += 1
            self._count["lane_rounds"] += len(ready)
            for live in ready:
                self._count["drafted"] += live.lane.stats.drafted - before[live][0]
                self._count["accepted"] += live.lane.stats.accepted - before[live][1]
        for live in ready:
            out = results.get(live.lane.lane, RuntimeError(f"the backend returned nothing for lane {live.lane.lane}"))
            if not isinstance(out, BaseException):
                out = self._checked(live.lane, out)
            if isinstance(out, BaseException):
                self._fail(live, out)
                continue
            live.lane.stats.emitted += len(out)
            self._emit(live, out)

    def _choose_drafts(self, lanes: list[LaneState]) -> None:
        """Adaptive draft length, decided for the cohort (engine.draft_policy): once the drafting lanes' rounds
        together clearly return fewer tokens than a round of their bucket costs in plain steps (beyond the
        measurement's noise), they all drop to K = 0 for the rest of their requests."""
        drafting = [lane for lane in lanes if lane.k]
        if drafting and not self.policy.keep_drafting(sum(lane.stats.rounds for lane in drafting),
                                                      sum(lane.stats.accepted for lane in drafting),
                                                      sum(lane.stats.drafted for lane in drafting), len(drafting)):
            for lane in drafting:
                lane.k = 0

    @staticmethod
    def _checked(lane: LaneState, out) -> list[int] | BaseException:
        """The adapter's tokens, or an error when they break the contract (1..budget, a stop token last)."""
        out = list(out)
        if not 1 <= len(out) <= lane.budget or any(t in lane.stop for t in out[:-1]):
            return RuntimeError(f"the backend's round gave lane {lane.lane} {len(out)} tokens {out[:8]} for a budget "
                                f"of {lane.budget} (stop tokens only last)")
        return out

    def _emit(self, live: _Live, tokens: list[int]) -> None:
        lane, req, now = live.lane, live.request, self.clock()
        lane.tokens += tokens
        live.t_first = live.t_first if live.t_first is not None else now
        live.t_last = now
        with self._lock:
            self._count["tokens"] += len(tokens)
        live.handle.tokens += tokens
        live.handle.send(Event(live.handle.id, tuple(tokens)))
        if tokens[-1] in req.stop:
            self._finish(live, "stop")
        elif len(lane.tokens) >= req.max_tokens or lane.room <= 0:
            self._finish(live, "length")

    def _fail(self, live: _Live, err: BaseException) -> None:
        self._finish(live, "error", f"{type(err).__name__}: {err}")

    def _finish(self, live: _Live, reason: str, error: str | None = None) -> None:
        """Releases the request's lane and sequence and sends its final event (callers hold the step)."""
        lane = live.lane
        if lane is not None and lane.seq is not None:
            lane.finish = reason
            try:
                self.backend.release(lane)
            except Exception as err:
                reason, error = "error", f"releasing its sequence failed: {type(err).__name__}: {err}"
        with self._lock:
            if lane is not None and self._lanes[lane.lane] is live:
                self._lanes[lane.lane] = None
            self._live.pop(live.handle.id, None)
            self._finished[reason] += 1
        t_first = live.t_first
        stats = RequestStats(
            prompt_tokens=len(live.request.prompt), tokens=len(lane.tokens) if lane else 0,
            queued_s=(live.t_admit if live.t_admit is not None else self.clock()) - live.t_submit,
            ttft_s=None if t_first is None else t_first - live.t_submit,
            decode_s=0.0 if t_first is None else live.t_last - t_first,
            rounds=lane.stats.rounds if lane else 0, drafted=lane.stats.drafted if lane else 0,
            accepted=lane.stats.accepted if lane else 0, cached_tokens=lane.cached if lane else 0)
        live.handle.final = Event(live.handle.id, (), reason, stats, error)
        live.handle.send(live.handle.final)
