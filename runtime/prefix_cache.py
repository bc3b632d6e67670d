"""Automatic prefix caching: full KV pages that later sequences reuse when their tokens start
the same way. The scheduler owns it (it owns every page table); the ranks only see page tables
in which some pages appear in more than one sequence.

A full page's key is SHA-256 over (the previous page's key, this page's token ids); the first
page chains from a salt naming the package (its digest) and the page size, so a key stands for
the whole prefix up to the end of its page and for nothing else that changes the KV. SHA-256
rather than Python's hash: keys cross users, and a predictable 64-bit hash lets a crafted prompt
collide with another user's prefix and read its KV (vLLM moved to SHA-256 for this reason).

A cached page is held by the sequences whose page tables contain it (`_refs`); when the last one
lets go it stays cached, idle, and is evicted least recently used only when the pool runs out of
free pages. Only full pages whose every token is known here and computed (by a step already
planned) are cached, and a sequence writes only pages past its cached ones, so a shared page is
never written again. A page becomes usable by others from the step after the one that completes
it: steps run in order on every rank, so its KV is written before any later step reads it.
Two sequences that compute the same page in the same step both keep their own copy; only the
first is cached.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


class PrefixCache:
    def __init__(self, salt: bytes, page_size: int):
        self.page_size = page_size
        self._root = hashlib.sha256(salt + page_size.to_bytes(4, "little")).digest()
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._ready_at: dict[int, int] = {}  # page -> id of the step that completes it
        self._refs: dict[int, int] = {}  # cached page -> sequences holding it (0: idle)
        self._idle: OrderedDict[int, None] = OrderedDict()  # held by none; least recent first
        self.prompt_tokens = 0  # of sequences admitted for the first time
        self.hit_tokens = 0  # of those, prompt tokens whose KV came from the cache
        self.evictions = 0

    @property
    def num_pages(self) -> int:
        return len(self._key_of)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    def refs(self, page: int) -> int:
        return self._refs.get(page, 0)

    def idle_pages(self) -> list[int]:
        return list(self._idle)

    def extend_keys(self, keys: list[bytes], tokens, count: int) -> None:
        """Append to keys (a sequence's keys so far, its first pages) until it has `count`;
        tokens(i, j) gives the sequence's token ids at positions [i, j)."""
        ps = self.page_size
        prev = keys[-1] if keys else self._root
        for i in range(len(keys), count):
            ids = array("l", tokens(i * ps, (i + 1) * ps)).tobytes()
            prev = hashlib.sha256(prev + ids).digest()
            keys.append(prev)

    def lookup(self, keys: list[bytes], step_id: int) -> tuple[list[int], bool]:
        """The cached pages of keys' leading run that step step_id may read, and whether the
        run goes on with a page that step step_id itself computes (worth waiting a step for)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                return pages, False
            if self._ready_at[page] >= step_id:
                return pages, True
            pages.append(page)
        return pages, False

    def hold(self, pages: list[int]) -> None:
        for page in pages:
            self._refs[page] += 1
            self._idle.pop(page, None)

    def release(self, page: int) -> bool:
        """A sequence lets go of page; False when the page is not cached (the caller frees it)."""
        refs = self._refs.get(page)
        if refs is None:
            return False
        self._refs[page] = refs - 1
        if refs == 1:
            self._idle[page] = None
        return True

    def register(self, page: int, key: bytes, step_id: int) -> bool:
        """Cache page, held by the one sequence that computed it, readable from step_id + 1;
        False when another page already holds this prefix (page stays private)."""
        if key in self._page_of:
            return False
        self._page_of[key], self._key_of[page] = page, key
        self._ready_at[page], self._refs[page] = step_id, 1
        return True

    def unregister_from(self, pages: list[int], step_id: int) -> None:
        """Uncache those of pages completed by step step_id: a step whose plan left their
        sequence out never writes them. None of them is shared yet (readable only later)."""
        for page in pages:
            if self._ready_at.get(page) == step_id:
                self._forget(page)

    def evict(self) -> int | None:
        """Uncache the least recently used idle page and return it, or None if none is idle."""
        if not self._idle:
            return None
        page, _ = self._idle.popitem(last=False)
        self._forget(page)
        self.evictions += 1
        return page

    def _forget(self, page: int) -> None:
        del self._page_of[self._key_of.pop(page)]
        del self._ready_at[page], self._refs[page]
        self._idle.pop(page, None)
