"""Free lists for the two kinds of cache memory: reference-counted KV pages (an unused cached page
stays on the LRU free list until handed out again) and GDN state slots; free counts are exact
after finish, abort and preemption. A cached page records the token that followed it (`after`),
which its MTP KV depends on (docs/speculative.md, "Prefix caching with MTP drafting")."""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict


class BlockManager:
    """Attention pages, shared by every full-attention layer (one block table per request)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self.ref: dict[int, int] = {}  # page -> requests using it (pages with ref 0 are free)
        self.hash_of: dict[int, int] = {}  # page -> the block hash it holds (cached pages)
        self.cached: dict[int, int] = {}  # block hash -> page
        self.after: dict[int, int] = {}  # cached page -> the token after it where it was computed
        self.num_evicted = 0  # cached pages handed out again

    @property
    def num_free(self) -> int:
        """Pages that can be allocated, cached pages no request uses included."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"need {n} KV blocks, {len(self._free)} free")
        ids = []
        for _ in range(n):
            i, _ = self._free.popitem(last=False)
            h = self.hash_of.pop(i, None)
            if h is not None:
                del self.cached[h]
                self.after.pop(i, None)
                self.num_evicted += 1
            self.ref[i] = 1
            ids.append(i)
        return ids

    def touch(self, ids: list[int]) -> None:
        """One more user of each (cached) page; a free one leaves the free list."""
        for i in ids:
            if i in self._free:
                del self._free[i]
                self.ref[i] = 1
            else:
                self.ref[i] += 1

    def free(self, ids: list[int]) -> None:
        """One user fewer of each page; a page nobody uses is free again (cached ones stay cached
        until handed out). The first page of `ids` is evicted first."""
        for i, n in Counter(ids).items():
            if self.ref.get(i, 0) < n:
                raise ValueError(f"KV block {i} freed twice or never allocated")
        for i in ids:
            self.ref[i] -= 1
            if self.ref[i] == 0:
                del self.ref[i]
                self._free[i] = None

    def register(self, page: int, block_hash: int, after: int | None = None) -> bool:
        """Page `page` (in use, fully written) holds the block `block_hash`, computed with token
        `after` next. False when another page already holds it (that one stays the cached copy)."""
        if block_hash in self.cached or page in self.hash_of:
            return False
        self.cached[block_hash] = page
        self.hash_of[page] = block_hash
        if after is not None:
            self.after[page] = after
        return True

    def lookup(self, block_hash: int, after: int | None = None) -> int | None:
        """The page caching `block_hash`; with `after`, only if it was computed with that token
        next (MTP: its last position's drafter KV is then this request's)."""
        page = self.cached.get(block_hash)
        if page is None or after is None or self.after.get(page) == after:
            return page
        return None

    def recent_pages(self, cap: int) -> list[int]:
        """At most `cap` cached pages: pages in use first, then free cached pages most recently
        freed first (the last to be evicted)."""
        out = [i for i in self.ref if i in self.hash_of][:cap]
        scanned = 0
        for i in reversed(self._free):
            if len(out) >= cap or scanned >= 4 * cap:  # bounded: most free pages hold no block
                break
            scanned += 1
            if i in self.hash_of:
                out.append(i)
        return out

    def is_free(self, page: int) -> bool:
        return page in self._free


class SlotPool:
    """GDN state slots: the same slot index in every GDN layer's conv and recurrent pools.
    The lowest free slot is handed out first, so a decode batch tends to occupy one contiguous
    run of slots, which the CPU path updates in place."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots))  # a heap
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        s = heapq.heappop(self._free)
        self._used.add(s)
        return s

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot} freed twice or never allocated")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)
