"""Free lists for the two kinds of cache memory: KV pages (grow with length) and GDN state
slots (one per live request). Free counts are exact after finish, abort and preemption."""

from __future__ import annotations

import heapq
from collections import deque


class BlockManager:
    """Attention pages, shared by every full-attention layer (one block table per request)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"need {n} KV blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise ValueError(f"KV block {i} freed twice or never allocated")
            self._used.remove(i)
            self._free.append(i)


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
