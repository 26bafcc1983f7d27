"""prefix: the prefix cache — checkpoints of committed sequences (their KV pages, pinned by reference
count, and a backend handle on a copy of their GDN state), found by the exact token chain they hold,
restored into a fresh sequence, evicted least recently used within a count and a byte bound. Pure
Python: the numbers stay in the backend, behind the protocol below; imports no CUDA.

A checkpoint of n tokens holds what a sequence had committed after exactly those tokens: the KV of
positions 0..n−1 in its pages (the MTP layer's KV lives in the same pages) and the recurrent state and
conv history of every GDN layer. Lookup is by a chained hash per full page (allocators.kv.page_hashes),
then an exact comparison of the tokens: a hash alone never decides. A sequence restored from it shares
the pages it only reads and gets private copies of those it will write (copy on write: the partial last
page, and any page from `private_from` on), so no holder ever sees another's writes.

Backend protocol (ReferenceBackend implements it; the GPU backend implements the same):

  state_bytes: int                  bytes one saved state takes (GDN state + conv history, every GDN layer)
  save_state(seq) -> handle         copy the GDN recurrent state and conv history of `seq`'s slot, every
                                    GDN layer, into the backend's checkpoint store; the handle is opaque.
                                    The store needs room for the cache's `capacity` handles at once: the
                                    cache frees one (`free_state`) before it saves beyond its capacity.
  restore_state(handle, seq)        copy the saved state into `seq`'s slot (bit for bit); the handle stays
  free_state(handle)                give the handle's storage back to the store
  copy_page(src, dst)               copy KV page `src` to page `dst`, every attention layer and the MTP
                                    layer, codes and scales: the whole page, bit for bit
  reserve(seq, length)             (allocators.sequences.SequencePool) pages for `length` tokens; a short
                                    pool calls the cache's `reclaim` first, once the pool's `prefix` is set

Every call comes from the engine's thread, between the backend's own calls, on committed states only (a
speculative lane is checkpointed after a round's commit, never between verify and commit).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from ninfer_gen.allocators.kv import OutOfPages, page_hashes


@dataclass(eq=False)
class Checkpoint:
    """A committed sequence of `len(tokens)` tokens: its pages (pinned) and its saved GDN state."""
    tokens: tuple[int, ...]
    pages: list[int]                   # pages of positions 0..n−1, one reference each held by the cache
    handle: Any                        # the backend's saved state (save_state)
    payload: Any = None                # the lane adapter's own data (e.g. the MTP's pending rows)
    nbytes: int = 0                    # state + payload bytes: what the byte bound counts

    @property
    def n(self) -> int:
        return len(self.tokens)


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0                # tokens restored instead of prefilled
    saves: int = 0
    evictions: int = 0                 # least recently used first: capacity, byte bound, clear
    reclaims: int = 0                  # evictions to give pages back to live sequences
    refused: int = 0                   # restores given up: no pages for the copies


class PrefixCache:
    """At most `capacity` checkpoints (0: none are kept) of at most `max_bytes` bytes of saved state
    and payload together (None: no byte bound), over `pool` (a SequencePool with the protocol above)."""

    def __init__(self, pool, capacity: int, max_bytes: int | None = None):
        if capacity < 0 or (max_bytes is not None and max_bytes < 0):
            raise ValueError(f"capacity and max_bytes must be ≥ 0, got {capacity}, {max_bytes}")
        self.pool, self.blocks = pool, pool.blocks
        self.capacity, self.max_bytes = capacity, max_bytes
        self._lru: OrderedDict[tuple[int, ...], Checkpoint] = OrderedDict()   # exact tokens → checkpoint
        self._buckets: dict[bytes, list[Checkpoint]] = {}    # hash of a checkpoint's full pages → checkpoints
        self._busy: Checkpoint | None = None                 # the one being restored: not evicted meanwhile
        self.bytes = 0
        self.stats = PrefixStats()

    @classmethod
    def on(cls, pool, capacity: int, max_bytes: int | None = None) -> "PrefixCache":
        """The pool's one cache (made now, or the existing one with these bounds): every adapter over a
        pool shares it, and the pool reclaims its pages when a live sequence needs them."""
        if pool.prefix is None:
            pool.prefix = cls(pool, capacity, max_bytes)
        else:
            pool.prefix.resize(capacity, max_bytes)
        return pool.prefix

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def pages(self) -> int:
        """Pages held by checkpoints only (no live sequence shares them): what `reclaim` can give back."""
        checkpoints = list(self._lru.values())     # one copy: engine.stats() reads this from other threads
        held = Counter(p for ck in checkpoints for p in ck.pages)
        return sum(self.blocks.refcount(p) == n for p, n in held.items())

    def usage(self) -> dict[str, int]:
        s = self.stats
        return {"prefix_checkpoints": len(self), "prefix_capacity": self.capacity, "prefix_bytes": self.bytes,
                "prefix_lookups": s.lookups, "prefix_hits": s.hits, "prefix_evictions": s.evictions,
                "pages_cached": self.pages}

    # ------------------------------------------------------------ finding
    def _bucket_key(self, tokens) -> bytes:
        hashes = page_hashes(tokens[:len(tokens) - len(tokens) % self.blocks.page_size], self.blocks.page_size)
        return hashes[-1] if hashes else b""

    def lookup(self, prompt, accept=None) -> Checkpoint | None:
        """The longest checkpoint whose tokens are exactly `prompt[:n]` with n ≤ len(prompt) − 1 (at least
        one token is left to prefill: the first output needs its logits) and that `accept(checkpoint)`
        takes (None: any); it becomes the most recently used."""
        self.stats.lookups += 1
        prompt = tuple(prompt)
        limit = len(prompt) - 1
        keys = [b""] + page_hashes(prompt[:limit], self.blocks.page_size)
        for key in reversed(keys):                  # bucket i holds the checkpoints of i full pages
            found = [ck for ck in self._buckets.get(key, ()) if ck.n <= limit and prompt[:ck.n] == ck.tokens
                     and (accept is None or accept(ck))]
            if found:
                best = max(found, key=lambda ck: ck.n)
                self._lru.move_to_end(best.tokens)
                return best
        return None

    # ------------------------------------------------------------ saving and restoring
    def save(self, seq, tokens, payload=None, payload_bytes: int = 0) -> Checkpoint | None:
        """Checkpoint `seq` (committed: its length is len(tokens), which its KV and state hold). An equal
        chain already cached is kept (made most recent) unless only the new one carries a payload. None
        when the cache keeps nothing (capacity 0, or one checkpoint exceeds the byte bound)."""
        tokens = tuple(tokens)
        if not tokens or len(tokens) != seq.length:
            raise ValueError(f"a checkpoint of {len(tokens)} tokens from a sequence of {seq.length}: the tokens "
                             "must be exactly what the sequence committed")
        old = self._lru.get(tokens)
        if old is not None and (old.payload is not None or payload is None):
            self._lru.move_to_end(tokens)
            return old
        nbytes = self.pool.state_bytes + payload_bytes
        if self.capacity == 0 or (self.max_bytes is not None and nbytes > self.max_bytes):
            return None
        if old is not None:
            self._drop(old)
        self._shrink(self.capacity - 1, None if self.max_bytes is None else self.max_bytes - nbytes)
        pages = list(seq.table.pages[:self.blocks.pages_for(len(tokens))])
        self.blocks.retain(pages)
        ck = Checkpoint(tokens, pages, self.pool.save_state(seq), payload, nbytes)
        self._lru[tokens] = ck
        self._buckets.setdefault(self._bucket_key(tokens), []).append(ck)
        self.bytes += nbytes
        self.stats.saves += 1
        return ck

    def restore(self, ck: Checkpoint, seq, private_from: int | None = None) -> bool:
        """Make the fresh sequence `seq` hold the checkpoint: the pages before `private_from` (default: n)
        shared, private copies of the rest of positions 0..n−1, the saved state in its slot, length n.
        False (and `seq` left fresh) when the pool has no pages for the copies."""
        if seq.length or seq.table.pages:
            raise ValueError("a checkpoint is restored into a fresh sequence (no pages, length 0)")
        cut = min(ck.n if private_from is None else private_from, ck.n) // self.blocks.page_size
        self.blocks.share(seq.table, ck.pages[:cut])
        self._busy = ck
        try:
            self.pool.reserve(seq, ck.n)
        except OutOfPages:
            self.blocks.free(seq.table)
            self.stats.refused += 1
            return False
        finally:
            self._busy = None
        for src, dst in zip(ck.pages[cut:], seq.table.pages[cut:]):
            self.pool.copy_page(src, dst)
        self.pool.restore_state(ck.handle, seq)
        seq.table.length = ck.n
        self.stats.hits += 1
        self.stats.hit_tokens += ck.n
        return True

    # ------------------------------------------------------------ eviction
    def resize(self, capacity: int, max_bytes: int | None = None) -> None:
        if capacity < 0 or (max_bytes is not None and max_bytes < 0):
            raise ValueError(f"capacity and max_bytes must be ≥ 0, got {capacity}, {max_bytes}")
        self.capacity, self.max_bytes = capacity, max_bytes
        self._shrink(capacity, max_bytes)

    def reclaim(self, pages: int) -> None:
        """Evict least recently used checkpoints until `pages` more pages are free (or none is left to
        evict): a live sequence needs them. Evicting one whose pages are shared frees none of those."""
        target = self.blocks.free_pages + pages
        while self.blocks.free_pages < target and self._evict_lru():
            self.stats.reclaims += 1

    def clear(self) -> None:
        """Evict every checkpoint: their states are freed and their pages released."""
        self._shrink(0, None)

    def _shrink(self, count: int, max_bytes: int | None) -> None:
        while len(self) > max(count, 0) or (max_bytes is not None and self.bytes > max(max_bytes, 0)):
            if not self._evict_lru():
                break

    def _evict_lru(self) -> bool:
        victim = next((ck for ck in self._lru.values() if ck is not self._busy), None)
        if victim is None:
            return False
        self._drop(victim)
        self.stats.evictions += 1
        return True

    def _drop(self, ck: Checkpoint) -> None:
        del self._lru[ck.tokens]
        key = self._bucket_key(ck.tokens)
        self._buckets[key].remove(ck)
        if not self._buckets[key]:
            del self._buckets[key]
        self.bytes -= ck.nbytes
        self.pool.free_state(ck.handle)
        self.blocks.release(ck.pages)
