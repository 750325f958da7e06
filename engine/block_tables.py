"""Decode rows' KV page tables kept between steps in host memory, one row per GDN state slot. A
decode row that continues the request its slot held in the step before writes only its new
pages (one every block_size tokens), where flattening every row's page list each step cost
O(context) a row in Python: at 32 rows of 4k tokens that was a quarter of a CPU decode step
(docs/benchmarks.md). Entries past a row's pages stay 0, as the lists' padding was."""

from __future__ import annotations

import numpy as np
import torch


class BlockTables:
    def __init__(self, max_pages: int, num_slots: int = 0):
        # the tables in numpy, and `table` over the same memory: numpy's gathers and small writes
        # cost a fraction of torch's on these sizes
        self._np = np.zeros((num_slots, max_pages), dtype=np.int64)
        self.table = torch.from_numpy(self._np)
        self._rid: list[str | None] = [None] * num_slots
        self._n = [0] * num_slots  # pages written in the slot's row
        self._tail = [-1] * num_slots  # the last of them
        self._seen = [-1] * num_slots  # the step that last wrote the slot's row
        self._step = 0

    def rows(self, rows) -> torch.Tensor:
        """The page tables of this step's decode rows (each has .request_id, .slot, .block_ids) as
        int64 [len(rows), widest row's pages]."""
        slots, width = self._update(rows)
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return self.table[first : first + len(slots), :width].contiguous()
        return self.table[slots, :width]

    def rows_into(self, rows, out: np.ndarray, slack: int = 0, cap: int = 0) -> int:
        """The same tables written packed into `out` (at least len(rows) x w entries, from its
        start): [len(rows), w] in row order, w the widest row's pages and `slack` more columns
        (zeros, or pages a row has beyond its length) up to `cap` (at most the table's; 0: the
        table's). Returns w."""
        slots, width = self._update(rows)
        width = max(width, min(width + slack, cap or self.table.shape[1]))
        np.take(self._np[:, :width], slots, axis=0, out=out[: len(slots) * width].reshape(len(slots), width))
        return width

    def _update(self, rows) -> tuple[list[int], int]:
        """Each row's table current in `table` (the rows' slots, the widest row's pages)."""
        self._step += 1
        step, rid, n, tail, seen, size = self._step, self._rid, self._n, self._tail, self._seen, len(self._n)
        width = 0
        for r in rows:
            s, pages = r.slot, r.block_ids
            m = len(pages)
            # most rows of a decode step: the slot's request, seen the step before, no new page
            if s < size and seen[s] == step - 1 and n[s] == m and m and rid[s] == r.request_id and pages[-1] == tail[s]:
                seen[s] = step
            else:
                self._write(s, r.request_id, pages)
                size = len(self._n)
            if m > width:
                width = m
        return [r.slot for r in rows], width

    def _grow(self, s: int) -> None:
        """Room for slot s (the table is sized by the slots seen: a profile step's, then the pools')."""
        extra = max(s + 1, 2 * len(self._n)) - len(self._n)
        self._np = np.concatenate([self._np, np.zeros((extra, self._np.shape[1]), dtype=np.int64)])
        self.table = torch.from_numpy(self._np)
        self._rid += [None] * extra
        self._n += [0] * extra
        self._tail += [-1] * extra
        self._seen += [-1] * extra

    def _write(self, s: int, rid: str, pages: list[int]) -> None:
        if s >= len(self._n):
            self._grow(s)
        n, m = self._n[s], len(pages)
        same = self._rid[s] == rid and self._seen[s] == self._step - 1 and n <= m
        t = self._np
        if not same or (n and pages[n - 1] != self._tail[s]):
            if m < n:
                t[s, m:n] = 0
            n = 0
        if m > n:
            t[s, n:m] = pages[n:m]
        self._rid[s], self._n[s], self._tail[s], self._seen[s] = rid, m, pages[-1] if m else -1, self._step
