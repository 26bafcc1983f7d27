"""device_rounds: speculative decoding on the GPU with every round one CUDA graph replay (compiler.round).

The host's part of a round is small: reserve the KV pages the round may touch (and write the block table
when a page was added), replay the round's graph, read back the lane's state row (the emitted tokens) —
one device→host copy per round. In fused mode the host keeps IN_FLIGHT rounds queued: it launches the
next round before it reads the last one back (a lane that finished makes the rounds after it padded
rows, which emit nothing), so the host's work overlaps the device's. Between rounds the round-state rows on the
device hold everything (committed length, anchor, drafts, budget, stop tokens, sampling parameters,
RNG counter); the round graph reads and updates them.

Modes (`round_mode`): `fused` — the commit (fold) of the accepted records is the first step of the next
round's graph; `eager` — the fold runs as its own graph after the host has read the round.
The first drafts of a request come from the MTP pass over its prompt (engine.speculative.Drafter).
"""
from __future__ import annotations

import struct
from collections import deque

import torch

from compiler.kernels import spec_round as sr
from ninfer_gen.engine.sampling import SamplingParams
from ninfer_gen.engine.speculative import Drafter, Stats, prompt_pass

ROUND_MODES = ("fused", "eager")
IN_FLIGHT = 2          # fused rounds queued ahead of the host's read-back (the device state carries everything)
_F = {name: i for i, name in enumerate(sr.ROUND_FIELDS)}


def _f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def round_row(seq, anchor: int, drafts: list[int], budget: int, params: SamplingParams, stop_ids, accept_prob,
              seed: int, trash_page: int) -> torch.Tensor:
    """The round-state row (host, int32 [ROW_WORDS]) of a lane whose prompt has been prefilled and drafted:
    RUNNING at the sequence's length with its anchor, drafts, budget, stop tokens, sampling parameters and
    RNG seed (the round counter starts at 0)."""
    stops = sorted(stop_ids or ())
    if len(stops) > sr.MAX_STOPS:
        raise ValueError(f"at most {sr.MAX_STOPS} stop tokens in a device round, got {len(stops)}")
    row = torch.zeros(sr.ROW_WORDS, dtype=torch.int32)
    values = {"length": seq.length, "budget": budget, "anchor": anchor, "state": sr.RUNNING, "slot": seq.slot,
              "trash": trash_page, "seed_lo": seed & 0x7FFFFFFF, "seed_hi": (seed >> 31) & 0x7FFFFFFF,
              "top_k": params.top_k, "temperature": _f32_bits(params.temperature), "top_p": _f32_bits(params.top_p),
              "n_stop": len(stops), "accept_prob": _f32_bits(accept_prob if accept_prob is not None else 0.0)}
    for name, v in values.items():
        row[_F[name]] = v
    row[sr.DRAFTS_AT:sr.DRAFTS_AT + len(drafts)] = torch.tensor(drafts, dtype=torch.int32)
    row[sr.STOPS_AT:sr.STOPS_AT + len(stops)] = torch.tensor(stops, dtype=torch.int32)
    return row


def idle_rows(backend, rows: torch.Tensor, batch: int):
    """For a round capture (Executable.capture_round): every lane idle and nothing to fold in the `batch`-lane
    commit bucket, so the warm-up touches no state; returns the function that puts both back."""
    saved = rows.clone()
    fold = backend.bucket("commit", batch, backend.profile.tail_tokens).inputs
    fold_saved = fold.device.clone()
    rows[:, _F["state"]] = sr.IDLE
    fold.set([], [], [], [])

    def restore():
        rows.copy_(saved)
        fold.device.copy_(fold_saved)
    return restore


class DeviceRounds:
    """The round-state rows of one GPU backend's lanes and the driver of its round graphs."""

    def __init__(self, backend, mode: str = "fused"):
        if mode not in ROUND_MODES:
            raise ValueError(f"round mode {mode!r}: expected one of {', '.join(ROUND_MODES)}")
        self.be, self.mode = backend, mode
        self.exe, self.k = backend.exe, backend.profile.draft
        self.T = self.k + 1
        self.rows = self.exe.round_buffers["round"].view(-1, sr.ROW_WORDS)
        self.tables = self.exe.round_buffers["tables"].view(self.rows.shape[0], -1)
        self.host = torch.zeros(sr.ROW_WORDS, dtype=torch.int32, pin_memory=True)
        self.ring = [torch.zeros(sr.ROW_WORDS, dtype=torch.int32, pin_memory=True) for _ in range(IN_FLIGHT + 1)]
        self._ring_at = 0
        self.rows[:, _F["state"]] = sr.IDLE
        self.active = None                  # (sequence, round) of the request being streamed

    # ------------------------------------------------------------ graphs
    def _round(self, acceptance: str):
        rnd = self.exe.round(1, acceptance, fold=self.mode == "fused")
        if self.be.use_graphs and rnd.graph is None:
            self.exe.capture_round(rnd, lambda: idle_rows(self.be, self.rows, 1))
        return rnd

    # ------------------------------------------------------------ one request
    def stream(self, prompt: list[int], max_new_tokens: int, params: SamplingParams,
               stop_ids: set[int] | None = None, stats: Stats | None = None, accept_prob: float | None = None,
               seed: int = 0):
        """Yields new tokens: prefill and the prompt's drafts on the host side, then device rounds.
        `accept_prob` (bench only): acceptance by a coin per draft with that probability."""
        be, k, T = self.be, self.k, self.T
        if stop_ids and len(stop_ids) > sr.MAX_STOPS:
            raise ValueError(f"at most {sr.MAX_STOPS} stop tokens in a device round, got {len(stop_ids)}")
        acceptance = "coin" if accept_prob is not None else ("greedy" if params.greedy else "sampled")
        rnd = self._round(acceptance)
        stats = stats if stats is not None else Stats()
        gen = torch.Generator()
        seed = params.seed if params.seed is not None else seed
        gen.manual_seed(seed)
        seq = be.new_sequence()
        self.active = (seq, rnd)
        try:
            anchor, hidden = prompt_pass(be, seq, prompt, params, gen)
            yield anchor
            produced = 1
            if produced >= max_new_tokens or (stop_ids and anchor in stop_ids) or seq.length + 2 * T - 2 > be.max_context:
                return
            drafts, q = Drafter(be, params, k, gen).propose(seq, hidden, list(prompt[1:]) + [anchor], 0)
            self._seed(seq, anchor, drafts, q, max_new_tokens - produced, params, stop_ids, accept_prob, seed)
            fold = be.bucket("commit", 1, T)
            depth = IN_FLIGHT if self.mode == "fused" else 1      # eager: the fold waits for the host
            inflight: deque = deque()
            launched, finished = seq.length, False                # launched: the length if every round kept T
            while True:
                # a round verifies L..L+K and drafts up to L' + K − 2 (L' ≤ L + T): all inside the context
                while not finished and len(inflight) < depth and launched + 2 * T - 2 <= be.max_context:
                    self._reserve(seq, min(launched + 2 * T, be.max_context))   # this round's verify and drafts
                    rnd.run(be.use_graphs)
                    buf = self._next_buffer()
                    buf.copy_(self.rows[0], non_blocking=True)
                    done = torch.cuda.Event()
                    done.record()
                    inflight.append((done, buf))
                    launched += T
                if not inflight:                  # no room to verify K+1 positions: stop at the context limit
                    return
                done, h = inflight.popleft()
                done.synchronize()
                self.host.copy_(h)
                n = int(h[_F["emitted"]])
                if n == 0:                        # a round launched after the lane finished: nothing ran
                    continue
                out = h[sr.OUT_AT:sr.OUT_AT + n].tolist()
                if self.mode == "eager":
                    fold.run(be.use_graphs)
                seq.table.length = int(h[_F["length"]])
                launched = seq.table.length + len(inflight) * T
                stats.rounds += 1
                stats.drafted += k
                stats.accepted += int(h[_F["accepted"]])
                stats.emitted.append(n)
                yield from out
                if int(h[_F["state"]]) != sr.RUNNING:
                    finished = True
                    if not inflight:
                        return
        finally:
            self.rows[0, _F["state"]] = sr.IDLE
            self.active = None
            be.release(seq)

    def time_replays(self, rounds: int) -> float:
        """Bench: the median device time (ms) of the running request's round graph replayed `rounds` times
        back to back with no host work between them (the pages for all of them reserved first; the lane
        keeps running on the device, so its length moves on and its stream should end after this)."""
        seq, rnd = self.active
        self.rows[0, _F["budget"]] = 1 << 30
        length = int(self.host[0])
        self._reserve(seq, min(length + (rounds + 2) * self.T, self.be.max_context))
        events = [torch.cuda.Event(enable_timing=True) for _ in range(rounds + 1)]
        events[0].record()
        for e in events[1:]:
            rnd.run(self.be.use_graphs)
            e.record()
        torch.cuda.synchronize()
        times = sorted(a.elapsed_time(b) for a, b in zip(events, events[1:]))
        return times[len(times) // 2]

    def _next_buffer(self) -> torch.Tensor:
        """The next read-back buffer of the ring (one more than the rounds in flight, so none is reused
        while its copy may still be pending)."""
        self._ring_at = (self._ring_at + 1) % len(self.ring)
        return self.ring[self._ring_at]

    def _seed(self, seq, anchor, drafts, q, budget, params, stop_ids, accept_prob, seed) -> None:
        """Lane 0's state row for a request whose prompt has been prefilled and drafted."""
        row = round_row(seq, anchor, drafts, budget, params, stop_ids, accept_prob, seed, self.be.state.trash_page)
        self.rows[0].copy_(row)
        self.host.copy_(row)
        if q is not None:                                     # the prompt's drafts' distributions (sampled)
            self.exe.round_buffers["q_dist"].view(-1, self.k, q.shape[-1])[0].copy_(q)
        self.be.bucket("commit", 1, self.T).inputs.set([], [], [], [])      # nothing to fold before round 1
        self._pages = -1

    def _reserve(self, seq, length: int) -> None:
        """Pages for `length` tokens; the lane's block-table row is written when a page was added."""
        self.be._reserve(seq, length)
        pages = seq.table.pages
        if len(pages) != self._pages:
            row = torch.full((self.tables.shape[1],), self.be.state.trash_page, dtype=torch.int32)
            row[:len(pages)] = torch.tensor(pages, dtype=torch.int32)
            self.tables[0].copy_(row)
            self._pages = len(pages)
