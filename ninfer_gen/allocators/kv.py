"""kv: the paged KV block manager — page allocation with reference counts (a page is shared by every
table or checkpoint that holds it and freed when the last lets go), trimming after rejected drafts, and
the chained page hashes that index token prefixes (`page_hashes`; allocators.prefix compares tokens too).

Pure Python: imports no CUDA, so it is tested on CPU. Page contents live in the runtime's pool.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


class OutOfPages(RuntimeError):
    pass


def page_hashes(tokens, page_size: int) -> list[bytes]:
    """Chained hash per full page: page i's hash covers tokens [0, (i+1)·page_size)."""
    out, h = [], b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        chunk = ",".join(map(str, tokens[start:start + page_size])).encode()
        h = hashlib.blake2b(h + chunk, digest_size=16).digest()
        out.append(h)
    return out


@dataclass
class BlockTable:
    """One sequence's pages in order; `length` tokens are valid."""
    pages: list[int] = field(default_factory=list)
    length: int = 0


class BlockManager:
    def __init__(self, num_pages: int, page_size: int = 64):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"need positive num_pages and page_size, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))   # pop() hands out low pages first
        self._refs = [0] * num_pages
        self._by_hash: dict[bytes, int] = {}               # full-page prefix hash → page
        self._hash_of: dict[int, bytes] = {}

    # ------------------------------------------------------------ accounting
    @property
    def free_pages(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # ------------------------------------------------------------ allocation
    def _take(self) -> int:
        if not self._free:
            raise OutOfPages(f"KV pool exhausted: all {self.num_pages} pages of {self.page_size} tokens are in use")
        page = self._free.pop()
        self._forget(page)
        self._refs[page] = 1
        return page

    def _forget(self, page: int) -> None:
        h = self._hash_of.pop(page, None)
        if h is not None and self._by_hash.get(h) == page:
            del self._by_hash[h]

    def _release(self, page: int) -> None:
        self._refs[page] -= 1
        assert self._refs[page] >= 0, f"page {page} released twice"
        if self._refs[page] == 0:
            self._free.append(page)  # keeps its hash until reused: a later request may still share it

    def reserve(self, table: BlockTable, tokens: int) -> None:
        """Grow `table` so it can hold `tokens` tokens; all-or-nothing."""
        need = self.pages_for(tokens) - len(table.pages)
        if need > len(self._free):
            raise OutOfPages(f"need {need} more KV pages, {len(self._free)} free")
        for _ in range(max(0, need)):
            table.pages.append(self._take())

    def trim(self, table: BlockTable, tokens: int) -> None:
        """Keep the first `tokens` tokens (rejected drafts roll back); frees whole pages past them."""
        if tokens > table.length:
            raise ValueError(f"cannot trim to {tokens} tokens: the sequence holds {table.length}")
        table.length = tokens
        keep = self.pages_for(tokens)
        for page in table.pages[keep:]:
            self._release(page)
        del table.pages[keep:]

    def free(self, table: BlockTable) -> None:
        for page in table.pages:
            self._release(page)
        table.pages.clear()
        table.length = 0

    # ------------------------------------------------------------ sharing held pages
    def retain(self, pages: list[int]) -> None:
        """One more reference to each of `pages`, which someone holds already (a table, a checkpoint)."""
        for page in pages:
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} is free: only a held page can be shared")
        for page in pages:
            self._refs[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each of `pages`; a page goes back to the pool with its last holder."""
        for page in pages:
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} is free: it cannot be released again")
            self._release(page)

    def share(self, table: BlockTable, pages: list[int]) -> None:
        """Append held `pages` to `table` (one more reference each): their contents are read, never written."""
        self.retain(pages)
        table.pages += pages

    # ------------------------------------------------------------ prefix sharing
    def _page_hashes(self, tokens: list[int]) -> list[bytes]:
        return page_hashes(tokens, self.page_size)

    def register_prefix(self, table: BlockTable, tokens: list[int]) -> None:
        """Publish the table's full pages (holding `tokens`) for reuse by later requests."""
        for page, h in zip(table.pages, self._page_hashes(tokens)):
            self._by_hash.setdefault(h, page)
            self._hash_of.setdefault(page, h)

    def match_prefix(self, tokens: list[int]) -> BlockTable:
        """A new table sharing the longest run of already-computed full pages of `tokens`
        (reference counts taken); `length` says how many tokens need no prefill."""
        table = BlockTable()
        for h in self._page_hashes(tokens):
            page = self._by_hash.get(h)
            if page is None or self._hash_of.get(page) != h:
                break
            if self._refs[page] == 0:
                self._free.remove(page)
            self._refs[page] += 1
            table.pages.append(page)
        table.length = len(table.pages) * self.page_size
        return table
