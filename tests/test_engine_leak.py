"""The cohort engine leaks nothing over 1,000 requests (issue 21's acceptance line): the tiny spec on the
reference backend, 8 lanes, prompts of 1–20 tokens (one to three prefill chunks), 1–4 new tokens, draft 0
and 3, greedy and sampled, a few ending at their own context limit, and every tenth request cancelled
mid-stream — half between steps, half from inside a round (as a server thread does while a step runs),
which the next step reaps. Afterwards every state slot and KV page is free, no lane is busy, every request's
handle and lane state are garbage, and Python's allocated blocks, its live objects and the RSS after 1,000
requests are those after the first 200, within bounds well under one block per request."""
import gc
import random
import sys
import weakref

import torch

from compiler.spec import load_spec
from ninfer_gen.engine import Engine, Request
from ninfer_gen.lanes.reference import ReferenceLanes
from ninfer_gen.api import TINY_SPEC
from ninfer_gen.sampling import SamplingParams
from ninfer_gen.reference import ReferenceBackend
from ninfer_gen.weights.random_weights import random_weights

REQUESTS, WARM, LANES, CONTEXT = 1000, 200, 8, 64
CANCEL_EVERY = 10                   # every tenth request is cancelled once its first tokens have arrived
CANCEL_TOKENS = 12                  # their budget: the first step and two rounds (≤ 1 + 4 + 4 tokens) cannot end them
BLOCKS_BOUND = 400                  # growth from request 200 to 1,000: allocator blocks (½ per request)
OBJECTS_BOUND = 200                 # and gc-tracked objects (¼ per request)
RSS_BOUND = 8 * 2 ** 20


class _Watched(ReferenceLanes):
    """Keeps a weak reference to every lane it opens, and cancels the requests in `cancel_in_round` from
    inside its next round, while the engine's step holds its lock."""

    def __init__(self, backend):
        super().__init__(backend)
        self.lanes: list[weakref.ref] = []
        self.engine, self.cancel_in_round = None, set()

    def open(self, lane):
        super().open(lane)
        self.lanes.append(weakref.ref(lane))

    def round(self, lanes):
        for rid in list(self.cancel_in_round):
            assert self.engine.cancel(rid)
        self.cancel_in_round.clear()
        return super().round(lanes)


def _cancelled(i: int) -> bool:
    return i % CANCEL_EVERY == CANCEL_EVERY - 1


def _request(i: int, rng: random.Random) -> tuple[Request, str]:
    """Request i and how it must end: every tenth is cancelled, one in 50 ends at its own context limit,
    one in 100 has a prompt longer than its limit (refused at admission)."""
    prompt = [rng.randrange(512) for _ in range(rng.randint(1, 20))]
    sampling = SamplingParams(1.0, seed=i) if i % 5 == 2 else SamplingParams()
    draft = rng.choice((0, 3))
    if _cancelled(i):
        return Request(prompt, CANCEL_TOKENS, sampling, draft=draft, id=f"q{i}"), "cancelled"
    if i % 50 == 7:
        return Request(prompt[:10], 4, sampling, draft=draft, id=f"q{i}", max_context=len(prompt[:10]) + 2), "length"
    if i % 100 == 33:
        return Request(prompt + [1] * 5, 4, sampling, draft=draft, id=f"q{i}", max_context=len(prompt) + 4), "error"
    return Request(prompt, rng.randint(1, 4), sampling, draft=draft, id=f"q{i}"), "length"


def _objects() -> tuple[int, int]:
    """Live gc-tracked objects but the test's own weak references (two per request), and the blocks
    Python's allocator holds (every object, tracked or not: strings, numbers, tuples of them)."""
    own = sum(type(o) is weakref.ReferenceType for o in gc.get_objects())
    return sys.getallocatedblocks() - own, len(gc.get_objects()) - own


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_thousand_requests_leak_nothing():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # the tiny spec's ops are microseconds: one thread runs them fastest
    try:
        _thousand_requests()
    finally:
        torch.set_num_threads(threads)


def _thousand_requests() -> None:
    spec = load_spec(TINY_SPEC)
    backend = ReferenceBackend(spec, random_weights(spec), device="cpu", max_sequences=LANES, max_context=CONTEXT)
    adapter = _Watched(backend)
    engine = adapter.engine = Engine(adapter, lanes=LANES, max_queue=LANES, prefill_budget=8)
    rng = random.Random(0)
    live: dict = {}                       # handle → its index; dropped when it ends
    pending: set[str] = set()             # ids to cancel once their first tokens have arrived
    handles: list[weakref.ref] = []
    finished, cancelled_tokens, marks = 0, [], {}
    while finished < REQUESTS:
        while len(handles) < REQUESTS and len(live) < 2 * LANES:
            i = len(handles)
            request, finish = _request(i, rng)
            handle = engine.submit(request)
            live[handle] = i, finish
            handles.append(weakref.ref(handle))
            if _cancelled(i):
                pending.add(handle.id)
        assert engine.step()
        for handle, (i, finish) in list(live.items()):
            handle.poll()
            if handle.final is not None:
                del live[handle]
                finished += 1
                assert handle.final.finish == finish, handle.final
                if _cancelled(i):
                    cancelled_tokens.append(len(handle.tokens))
                if finished in (WARM, REQUESTS):
                    del handle
                    gc.collect()
                    marks[finished] = (*_objects(), _rss())
            elif handle.id in pending and handle.tokens:
                pending.discard(handle.id)
                if i // CANCEL_EVERY % 2:
                    adapter.cancel_in_round.add(handle.id)      # reaped by the step after that round
                else:
                    assert handle.cancel()                    # no step runs: freed at once
    stats = engine.stats()
    assert not engine.step()
    assert stats["finished"] == {"length": REQUESTS - 110, "cancelled": 100, "error": 10}
    assert stats["lanes_busy"] == stats["queue_depth"] == stats["slots_in_use"] == stats["pages_in_use"] == 0
    assert backend.slots.free_slots == backend.slots.num_slots and backend.blocks.free_pages == backend.blocks.num_pages
    assert all(1 <= n < CANCEL_TOKENS for n in cancelled_tokens)                 # each cancelled mid-stream
    gc.collect()
    assert not [r for r in handles if r() is not None], "handles of finished requests are still alive"
    assert not [r for r in adapter.lanes if r() is not None], "lane states of finished requests are still alive"
    (blocks, objects, rss), (blocks_end, objects_end, rss_end) = marks[WARM], marks[REQUESTS]
    assert blocks_end - blocks < BLOCKS_BOUND, (blocks, blocks_end)
    assert objects_end - objects < OBJECTS_BOUND, (objects, objects_end)
    assert rss_end - rss < RSS_BOUND, (rss, rss_end)
