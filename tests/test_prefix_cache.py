"""Prefix reuse (issue 22 item 4): the page reference counts and the PrefixCache on a fake pool (exact
lookup, longest proper prefix, copy on write, LRU by count and bytes, pages reclaimed for live sequences,
clear); the cohort engine on the tiny spec (a chunk-boundary checkpoint restores bit for bit, sampled and
K = 3; lanes with drafts restore only checkpoints with an MTP tail; a cancelled answer leaves none; the
pool under pressure; 60 requests through a full, evicting cache leak nothing); and the second turn of a
conversation on the shipped small model, K = 0 and K = 3: only the new tokens are prefilled and the output
equals the output without reuse, token for token; `serve --prefix-cache N`. lab/prefix_reuse.py times the 8K-token
conversation."""
import random

import pytest

import ninfer_gen
from compiler.spec import load_spec
from ninfer_gen.allocators import prefix as prefix_mod
from ninfer_gen.allocators.kv import BlockManager, BlockTable
from ninfer_gen.allocators.prefix import PrefixCache
from ninfer_gen.allocators.sequences import SequencePool
from ninfer_gen.engine import Engine, Request
from ninfer_gen.lanes.reference import ReferenceLanes
from ninfer_gen.api import DEFAULT_MODEL, TINY_SPEC
from ninfer_gen.sampling import SamplingParams
from ninfer_gen.reference import ReferenceBackend
from ninfer_gen.weights.random_weights import random_weights


# ---------------------------------------------------------------- the allocators, on a fake pool
class FakePool(SequencePool):
    """A pool whose "state" is the handle's number: records what the cache asks of a backend."""
    state_bytes = 100

    def __init__(self, pages: int = 16, page_size: int = 4):
        super().__init__(num_slots=4, num_pages=pages, page_size=page_size, max_context=page_size * pages)
        self.handles, self.next_handle, self.copies, self.restored = set(), 0, [], []

    def _reset_slot(self, slot: int) -> None:
        pass

    def save_state(self, seq):
        self.next_handle += 1
        self.handles.add(self.next_handle)
        return self.next_handle

    def restore_state(self, handle, seq):
        assert handle in self.handles
        self.restored.append((handle, seq.slot))

    def free_state(self, handle):
        self.handles.remove(handle)          # a double free fails here

    def copy_page(self, src, dst):
        self.copies.append((src, dst))

    def committed(self, tokens: int):
        seq = self.new_sequence()
        self.reserve(seq, tokens)
        seq.table.length = tokens
        return seq


def test_a_shared_page_is_freed_by_its_last_holder():
    bm = BlockManager(num_pages=4, page_size=4)
    a, b = BlockTable(), BlockTable()
    bm.reserve(a, 8)
    bm.share(b, a.pages[:1])
    assert b.pages == a.pages[:1] and bm.refcount(a.pages[0]) == 2 and bm.free_pages == 2
    bm.free(a)
    assert bm.refcount(b.pages[0]) == 1 and bm.free_pages == 3          # b still holds the shared page
    bm.free(b)
    assert bm.free_pages == 4
    with pytest.raises(ValueError, match="is free"):
        bm.retain([0])
    with pytest.raises(ValueError, match="is free"):
        bm.release([0])


def test_lookup_finds_the_longest_exact_proper_prefix(monkeypatch):
    pool = FakePool()
    cache = PrefixCache(pool, capacity=8)
    toks = list(range(100, 120))
    for n in (3, 6, 9, 13):
        seq = pool.committed(n)
        cache.save(seq, toks[:n])
        pool.release(seq)
    assert cache.lookup(toks[:14]).n == 13
    assert cache.lookup(toks[:13]).n == 9            # at least one token is left to prefill
    assert cache.lookup(toks[:11] + [7, 7, 7]).n == 9
    assert cache.lookup([1] + toks[1:]) is None
    assert cache.lookup(toks, accept=lambda ck: ck.n < 8).n == 6
    # every chain hashes alike: the tokens still decide (a hash alone never does)
    monkeypatch.setattr(prefix_mod, "page_hashes", lambda tokens, size: [b"same"] * (len(tokens) // size))
    cache = PrefixCache(pool, capacity=8)
    for chain in ([5] * 9, [6] * 9):
        seq = pool.committed(9)
        cache.save(seq, chain)
        pool.release(seq)
    assert cache.lookup([6] * 12).tokens == (6,) * 9 and cache.lookup([7] * 12) is None


def test_restore_shares_what_it_reads_and_copies_what_it_writes():
    pool = FakePool()
    cache = PrefixCache(pool, capacity=4)
    seq = pool.committed(10)                          # pages 0..2, the last one partial
    ck = cache.save(seq, range(10))
    pages = list(seq.table.pages)
    assert ck.pages == pages and all(pool.blocks.refcount(p) == 2 for p in pages)
    pool.release(seq)
    new = pool.new_sequence()
    assert cache.restore(ck, new)
    assert new.length == 10 and new.table.pages[:2] == pages[:2] and new.table.pages[2] != pages[2]
    assert pool.copies == [(pages[2], new.table.pages[2])] and pool.restored == [(ck.handle, new.slot)]
    assert [pool.blocks.refcount(p) for p in pages] == [2, 2, 1]
    other = pool.new_sequence()                       # it writes from position 5 on: pages 1 and 2 private
    assert cache.restore(ck, other, private_from=5)
    assert other.table.pages[0] == pages[0] and set(other.table.pages[1:]).isdisjoint(pages)
    with pytest.raises(ValueError, match="fresh sequence"):
        cache.restore(ck, other)
    with pytest.raises(ValueError, match="exactly what the sequence committed"):
        cache.save(other, range(9))
    pool.release(new)
    pool.release(other)
    cache.clear()
    assert pool.blocks.free_pages == pool.blocks.num_pages and not pool.handles


def test_least_recently_used_goes_first_within_count_and_bytes():
    pool = FakePool(pages=32)
    cache = PrefixCache(pool, capacity=3)
    cks = []
    for i in range(3):
        seq = pool.committed(5)
        cks.append(cache.save(seq, [i] * 5))
        pool.release(seq)
    assert cache.lookup([0] * 6) is cks[0]            # used: now the most recent
    seq = pool.committed(5)
    cache.save(seq, [3] * 5)
    pool.release(seq)
    assert cache.lookup([1] * 6) is None and cache.lookup([0] * 6) is cks[0]
    assert len(cache) == 3 and cache.stats.evictions == 1 and len(pool.handles) == 3
    assert pool.blocks.free_pages == 32 - 3 * 2       # the evicted checkpoint's pages are back
    assert cache.save(pool.committed(5), [0] * 5) is cks[0]         # an equal chain: kept, not saved twice
    cache.resize(3, max_bytes=250)                    # 100 bytes of state each: two fit
    assert len(cache) == 2 and cache.bytes == 200
    assert PrefixCache(pool, capacity=0).save(pool.committed(5), [9] * 5) is None


def test_a_short_pool_takes_pages_back_from_the_cache():
    pool = FakePool(pages=8)
    cache = PrefixCache.on(pool, capacity=4)
    for i in range(3):                                # three checkpoints pin 2 pages each
        seq = pool.committed(6)
        cache.save(seq, [i] * 6)
        pool.release(seq)
    assert pool.blocks.free_pages == 2
    seq = pool.committed(20)                          # 5 pages: the two oldest checkpoints give theirs back
    assert len(cache) == 1 and cache.stats.reclaims == 2 and cache.lookup([2] * 7) is not None
    assert cache.usage()["pages_cached"] == 2 and PrefixCache.on(pool, 4) is cache
    pool.release(seq)
    cache.clear()
    assert pool.blocks.free_pages == 8 and not pool.handles


# ---------------------------------------------------------------- the engine, on the tiny spec
CONTEXT = 256
pytestmark = pytest.mark.usefixtures("one_thread_module")     # tiny ops: one torch thread (conftest)


@pytest.fixture(scope="module")
def tiny():
    spec = load_spec(TINY_SPEC)
    return spec, random_weights(spec)


@pytest.fixture
def backend(tiny):
    return ReferenceBackend(*tiny, device="cpu", max_sequences=4, max_context=CONTEXT)


def _run(engine, *requests) -> list:
    handles = [engine.submit(r) for r in requests]
    engine.run_until_idle()
    return [h.result() and h for h in handles]


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def test_a_chunk_boundary_checkpoint_restores_bit_for_bit(backend):
    """A 100-token prompt in chunks of 16 leaves checkpoints at 48 and 96 (every 48 tokens) and at 100. A
    prompt sharing its first 60 tokens restores the one at 48 and continues with the same chunks as
    without reuse: sampled tokens (the same random draws over the same logits) and K = 3 rounds equal."""
    first, second = _prompt(100, 1), _prompt(100, 1)[:60] + _prompt(30, 2)
    for request in (Request(second, 12, SamplingParams(1.0, seed=5)), Request(second, 12, draft=3),
                    Request(second, 12, SamplingParams(0.9, top_k=40, seed=6), draft=3)):
        want = _run(Engine(ReferenceLanes(backend), lanes=1, prefill_budget=16), request)[0].tokens
        reuse = ReferenceLanes(backend, prefix_cache=4, checkpoint_every=48)
        engine = Engine(reuse, lanes=1, prefill_budget=16)
        _run(engine, Request(first, 3, draft=request.draft))
        before = engine.stats()["prefill_tokens"]
        h = _run(engine, request)[0]
        assert h.tokens == want and h.final.stats.cached_tokens == 48
        assert engine.stats()["prefill_tokens"] - before == len(second) - 48
        reuse.backend.prefix.clear()


def test_lanes_with_drafts_restore_only_checkpoints_with_an_mtp_tail(backend):
    """A K = 0 answer's checkpoints (no MTP tail) serve a K = 0 lane, not a K = 3 one; a K = 3 lane's serve
    both; a cancelled answer leaves no checkpoint (its prompt's stays)."""
    prompt = _prompt(70, 3)
    engine = Engine(ReferenceLanes(backend, prefix_cache=8), lanes=2, prefill_budget=32)
    answer = _run(engine, Request(prompt, 4))[0].tokens                   # K = 0: no MTP tail
    k3, k0 = _run(engine, Request(prompt + answer + [501], 4, draft=3), Request(prompt + answer + [502], 4))
    assert k3.final.stats.cached_tokens == 0 and k0.final.stats.cached_tokens == 73     # 70 + 4 − 1
    again = _run(engine, Request(prompt + answer + [501] + k3.tokens + [503], 4))[0]
    assert again.final.stats.cached_tokens == 75 + 3                     # K = 3's answer serves K = 0
    cancelled = engine.submit(Request(prompt + [504, 505, 506], 50, draft=3))
    for _ in range(4):
        engine.step()
    assert cancelled.tokens and cancelled.cancel()
    engine.run_until_idle()
    h = _run(engine, Request(prompt + [504, 505, 506] + cancelled.tokens + [507], 4, draft=3))[0]
    assert h.final.stats.cached_tokens == 73                   # the prompt's checkpoint, not the answer's
    assert engine.stats()["prefix_hit_tokens"] == 73 + 78 + 73


def test_the_pool_under_pressure_evicts_checkpoints_for_live_requests(tiny):
    backend = ReferenceBackend(*tiny, device="cpu", max_sequences=2, max_context=CONTEXT)   # 8 pages
    engine = Engine(ReferenceLanes(backend, prefix_cache=8), lanes=2, prefill_budget=64)
    _run(engine, *(Request(_prompt(120, i), 2) for i in range(4)))       # 4 × (prompt + answer): 2 pages each
    assert engine.stats()["pages_cached"] == 8 and backend.blocks.free_pages == 0
    long = _run(engine, Request(_prompt(250, 9), 4), Request(_prompt(130, 8), 4))
    assert [h.final.finish for h in long] == ["length", "length"] and backend.prefix.stats.reclaims > 0
    assert engine.stats()["pages_in_use"] == engine.stats()["pages_cached"]


def test_a_full_evicting_cache_leaks_nothing(backend):
    """60 requests (K = 0 and 3, greedy and sampled, a few cancelled) over 4 lanes, on prompts that share
    prefixes, through a cache of 5 checkpoints: afterwards every slot is free and every page in use is a
    checkpoint's alone; clearing the cache frees them all."""
    rng = random.Random(7)
    roots = [_prompt(rng.randint(20, 90), 50 + i) for i in range(6)]
    adapter = ReferenceLanes(backend, prefix_cache=5, checkpoint_every=32)
    engine = Engine(adapter, lanes=4, max_queue=64, prefill_budget=24)
    handles = []
    for i in range(60):
        prompt = rng.choice(roots)[:rng.randint(10, 90)] + _prompt(rng.randint(1, 20), 200 + i)
        sampling = SamplingParams(1.0, seed=i) if i % 4 == 1 else SamplingParams()
        handles.append(engine.submit(Request(prompt, rng.randint(1, 6), sampling, draft=rng.choice((0, 3)))))
        if i % 3 == 2:
            engine.step()
        if i % 11 == 5:
            handles[-2].cancel()
    engine.run_until_idle()
    stats = engine.stats()
    assert sum(stats["finished"].values()) == 60 and stats["prefix_hit_tokens"] > 0
    assert stats["prefix_evictions"] > 0 and stats["prefix_checkpoints"] == 5
    assert stats["slots_in_use"] == 0 and stats["pages_in_use"] == stats["pages_cached"] > 0
    pinned = {p for ck in backend.prefix._lru.values() for p in ck.pages}
    assert len(pinned) == stats["pages_in_use"]
    backend.prefix.clear()
    assert backend.blocks.free_pages == backend.blocks.num_pages and engine.stats()["pages_in_use"] == 0


# ---------------------------------------------------------------- a conversation on the small model
@pytest.fixture(scope="module")
def small():
    return ninfer_gen.load(DEFAULT_MODEL)


def _conversation(model, first: int, new: int, answer: int, draft: int) -> None:
    """Turn 1: `first` prompt tokens, `answer` greedy tokens; turn 2 = turn 1 + its answer + `new` tokens.
    With reuse turn 2 restores turn 1's answer checkpoint and prefills only the new tokens (and the answer's
    last token, which was never run); its tokens equal turn 2 run without reuse."""
    ids = model.tokenizer.encode((DEFAULT_MODEL.parent.parent / "ninfer_gen" / "engine" / "engine.py").read_text()
                                 + (DEFAULT_MODEL.parent.parent / "ninfer_gen" / "lanes" / "contract.py").read_text())
    assert len(ids) >= first + new
    reuse = ReferenceLanes.for_model(model, 1, prefix_cache=4)
    engine = Engine(reuse, lanes=1)
    turn1 = _run(engine, Request(ids[:first], answer, draft=draft))[0]
    second = ids[:first] + turn1.tokens + ids[first:first + new]
    before = engine.stats()["prefill_tokens"]
    turn2 = _run(engine, Request(second, answer, draft=draft))[0]
    assert turn2.final.stats.cached_tokens == first + answer - 1
    assert engine.stats()["prefill_tokens"] - before == new + 1
    fresh = _run(Engine(ReferenceLanes(reuse.backend), lanes=1), Request(second, answer, draft=draft))[0]
    assert turn2.tokens == fresh.tokens
    if draft:
        assert turn2.final.stats.acceptance == fresh.final.stats.acceptance > 0
    reuse.backend.prefix.clear()


def test_second_turn_prefills_only_the_new_tokens_and_equals_no_reuse(small):
    _conversation(small, 4600, 300, 24, 0)


def test_second_turn_with_drafts_equals_no_reuse(small):
    _conversation(small, 1100, 200, 24, 3)


def test_serve_prefix_cache_flag():
    from ninfer_gen.cli.main import build_parser
    from ninfer_gen.cli.serve import build_server

    for flag, expected in (([], 16), (["--prefix-cache", "3"], 3), (["--prefix-cache", "0"], None)):
        _, engine, _ = build_server(build_parser().parse_args(["serve", "--weights", str(TINY_SPEC), "--lanes", "1",
                                                               *flag]))
        reuse = engine.backend.reuse
        assert (reuse.cache.capacity if reuse is not None else None) == expected
    with pytest.raises(ValueError, match="--prefix-cache"):
        build_server(build_parser().parse_args(["serve", "--weights", str(TINY_SPEC), "--prefix-cache", "-1"]))
