"""Per-request token counts on the device for requests with presence / frequency / repetition
penalties (a sparse table of each request's distinct tokens, updated by each step without a host
read; the tables of a step's new requests built on the host and loaded in the sampler's one
upload), and their batched application (docs/api.md, "Sampling applies, in order")."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from engine.sampling.pack import HostPack, Sections


@dataclass
class _Entry:
    row: int
    covered: int  # output tokens counted
    last: int | None  # the last of them
    bound: int  # entries the row may use (distinct tokens at build + tokens added since)


class TokenCounts:
    def __init__(self, vocab_size: int, device: torch.device, fused: bool = False):
        """fused: apply and record in Triton kernels (kernels/triton/sampling.py)."""
        self.vocab, self.device, self.fused = vocab_size, device, fused
        self.entries: dict[str, _Entry] = {}
        self.free: list[int] = []
        self.tok = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.cnt = torch.zeros(0, 0, dtype=torch.int32, device=device)
        self.inp = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.size = torch.zeros(0, dtype=torch.long, device=device)
        self.widest = 0  # the largest bound of the requests `rows` or `current` last saw, advanced since

    def _resize(self, rows: int, width: int) -> None:
        n, w = self.tok.shape
        d = self.device
        tok, cnt = (
            torch.zeros(rows, width, dtype=torch.long, device=d),
            torch.zeros(rows, width, dtype=torch.int32, device=d),
        )
        inp, size = torch.zeros(rows, width, dtype=torch.bool, device=d), torch.zeros(rows, dtype=torch.long, device=d)
        tok[:n, :w], cnt[:n, :w], inp[:n, :w], size[:n] = self.tok, self.cnt, self.inp, self.size
        self.free += range(rows - 1, n - 1, -1)
        self.tok, self.cnt, self.inp, self.size = tok, cnt, inp, size

    def drop(self, request_ids) -> None:
        for r in request_ids:
            e = self.entries.pop(r, None)
            if e is not None:
                self.free.append(e.row)

    def rows(self, request_ids: list[str], histories, pack: HostPack, drafts: list[int] | None = None) -> list[int]:
        """The table row of each request, with room for one more entry each (and one per draft,
        `drafts[i]` of them). Rows missing or stale are built from their (prompt, output) ids
        into `pack` (sections "counts.*", all new rows in one upload) for `load` to write on the
        device."""
        out, built = [], []
        for rid, (prompt, output) in zip(request_ids, histories):
            e = self.entries.get(rid)
            last = output[-1] if output else None
            if e is None or e.covered != len(output) or e.last != last:
                e, entries = self._build(rid, prompt, output)
                built.append((e.row, entries))
            out.append(e.row)
        more = drafts if drafts else [0] * len(request_ids)
        need = max(self.entries[r].bound + k for r, k in zip(request_ids, more)) + 1
        self.widest = need - 1
        if need > self.tok.shape[1]:
            self._resize(self.tok.shape[0], max(need, 2 * self.tok.shape[1], 64))
        if built:
            w = self.tok.shape[1]
            pack.ints("counts.rows", [row for row, _ in built])
            pack.ints("counts.size", [len(ent) for _, ent in built])
            pack.ints("counts.flat", [row * w + j for row, ent in built for j in range(len(ent))])
            pack.ints("counts.entries", [x for _, ent in built for t in ent for x in t])
        return out

    def current(self, request_ids: list[str], histories) -> bool:
        """Whether `rows` would build nothing for these requests and needs no wider table: each
        has its table, counting its outputs so far, with room for one more entry."""
        w, widest = self.tok.shape[1], 0
        for rid, (_, output) in zip(request_ids, histories):
            e = self.entries.get(rid)
            if e is None or e.covered != len(output) or e.last != (output[-1] if output else None) or e.bound >= w:
                return False
            widest = max(widest, e.bound)
        self.widest = widest
        return True

    def room(self) -> bool:
        """Whether the requests `rows` or `current` last saw (advanced since) each have room for
        one more entry: `current` for a call over them again, their histories known to be counted."""
        return self.widest < self.tok.shape[1]

    def _build(self, rid: str, prompt: list[int], output: list[int]) -> tuple[_Entry, list[tuple[int, int, int]]]:
        """The request's entry (a table row taken where it has none) and its table on the host:
        (token, count in the output, 1 if in the prompt) for each distinct token, ascending."""
        e = self.entries.get(rid)
        if e is None:
            if not self.free:
                self._resize(max(4, 2 * self.tok.shape[0]), self.tok.shape[1])
            e = self.entries[rid] = _Entry(self.free.pop(), 0, None, 0)
        v = self.vocab
        counts = Counter(t for t in output if t < v)
        in_prompt = {t for t in prompt if t < v}
        toks = sorted(in_prompt | set(counts))
        e.covered, e.last, e.bound = len(output), (output[-1] if output else None), len(toks)
        return e, [(t, counts[t], int(t in in_prompt)) for t in toks]

    def take(self, n: int) -> list[int]:
        """n table rows lent to a call (draft positions' tables, engine/sampling/adjust.py)."""
        while len(self.free) < n:
            self._resize(max(4, 2 * self.tok.shape[0]), self.tok.shape[1])
        return [self.free.pop() for _ in range(n)]

    def give(self, rows: list[int]) -> None:
        """Rows `take` lent, back."""
        self.free += rows

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Table rows dst [S] become copies of rows src [S], on the device."""
        self.tok[dst], self.cnt[dst], self.inp[dst], self.size[dst] = (
            self.tok[src],
            self.cnt[src],
            self.inp[src],
            self.size[src],
        )

    def load(self, s: Sections) -> None:
        """Write the rows `rows` built into the uploaded sections, on the device."""
        rows, flat = s["counts.rows"], s["counts.flat"]
        ent = s["counts.entries"].view(-1, 3)
        self.cnt.index_fill_(0, rows, 0)  # a scalar fill: no host tensor to copy, as `[rows] = 0` makes
        self.inp.index_fill_(0, rows, False)
        self.tok.view(-1)[flat] = ent[:, 0]
        self.cnt.view(-1)[flat] = ent[:, 1].int()
        self.inp.view(-1)[flat] = ent[:, 2].bool()
        self.size[rows] = s["counts.size"]

    def record(
        self, rows: torch.Tensor, tokens: torch.Tensor, at: torch.Tensor | None, keep: torch.Tensor | None = None
    ) -> None:
        """Table row rows[i] (distinct rows) counts the sampled token tokens[at[i]] (at None:
        tokens[i]), on the device: its count goes up, in a new entry when the row has none for
        it. keep bool [P]: only the rows where it is set count (in PyTorch ops on every device)."""
        if self.fused and keep is None and at is not None:
            from kernels.triton.sampling import record_triton

            return record_triton(rows, at, tokens, self.tok, self.cnt, self.size)
        if at is not None:
            tokens = tokens[at]
        size = self.size[rows]
        used = torch.arange(self.tok.shape[1], device=rows.device) < size[:, None]
        match = (self.tok[rows] == tokens[:, None]) & used
        found = match.any(-1)
        slot = torch.where(found, match.int().argmax(-1), size)
        if keep is None:
            self.tok[rows, slot] = tokens
            self.cnt[rows, slot] += 1
            self.size[rows] = size + (~found).long()
            return
        # a row not kept writes its own entry back (slot < width: `rows` left room for its drafts)
        self.tok[rows, slot] = torch.where(keep, tokens, self.tok[rows, slot])
        self.cnt[rows, slot] += keep.int()
        self.size[rows] = size + (~found & keep).long()

    def advance(self, request_ids: list[str], emitted: list[list[int]]) -> None:
        """The host's side of `record`, once the sampled ids are read: each request's emitted ids."""
        for rid, ts in zip(request_ids, emitted):
            e = self.entries[rid]
            e.covered, e.last, e.bound = e.covered + len(ts), ts[-1], e.bound + len(ts)
            if e.bound > self.widest:
                self.widest = e.bound

    def apply(
        self, x: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, rep: torch.Tensor | None, pf: torch.Tensor | None
    ) -> None:
        """In place on x [N, V]: at positions `pos` [P] (table rows `rows` [P]) the repetition
        penalty rep [P] on tokens of the prompt or output, then minus presence penalty pf[:, 0]
        for each output token and frequency penalty pf[:, 1] per occurrence (None: no row has
        one). Only the table's entries are read and written."""
        if self.fused:
            from kernels.triton.sampling import penalties_triton

            return penalties_triton(x, pos, rows, self.tok, self.cnt, self.inp, self.size, rep, pf)
        d = x.device
        tok, cnt = self.tok[rows], self.cnt[rows].float()
        at = pos[:, None].expand_as(tok)
        old = x[at, tok]
        new = old
        if rep is not None:
            r = rep[:, None]
            seen = self.inp[rows] | (cnt > 0)
            new = torch.where(seen, torch.where(old > 0, old / r, old * r), old)
        if pf is not None:
            new = new - (pf[:, :1] * (cnt > 0) + pf[:, 1:] * cnt)
        # unused entries write their row's first entry again: duplicate indices, identical values
        used = torch.arange(tok.shape[1], device=d) < self.size[rows][:, None]
        x[at, torch.where(used, tok, tok[:, :1])] = torch.where(used, new, new[:, :1])
