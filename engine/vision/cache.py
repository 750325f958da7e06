"""The encoder-output cache of one rank: an image's embeddings kept by its pixel hash within a
byte budget, least recently used evicted first, so an image sent again (or the next prefill
chunk of the same image) skips the encoder."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self._lru: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        t = self._lru.get(key)
        if t is None:
            self.misses += 1
            return None
        self._lru.move_to_end(key)
        self.hits += 1
        return t

    def put(self, key: bytes, value: torch.Tensor) -> None:
        """Keep `value` unless it alone exceeds the budget; evict the oldest until it fits."""
        size = value.numel() * value.element_size()
        if size > self.budget or key in self._lru:
            return
        while self.used + size > self.budget:
            _, old = self._lru.popitem(last=False)
            self.used -= old.numel() * old.element_size()
        self._lru[key] = value
        self.used += size

    def __len__(self) -> int:
        return len(self._lru)
