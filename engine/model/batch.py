"""ForwardBatch: the tensors of one model step, built by a worker from a `StepInput`.

Tokens are packed; rows (one per scheduled request) are ordered decode rows first (one new
token each, recurrent GDN path) then prefill rows (a prompt chunk each, chunked GDN path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.points import StatePoints


@dataclass
class RowGroup:
    """A contiguous run of rows and their tokens [tok_start, tok_end)."""

    tok_start: int
    tok_end: int
    cu_seqlens: torch.Tensor  # [B+1], rebased to the group's first token
    slot_ids: torch.Tensor  # [B] GDN state slot of each row
    has_initial_state: torch.Tensor  # [B] bool: the row continues a sequence already in its slot
    seq_lens: torch.Tensor  # [B] tokens in context including this step's
    block_tables: torch.Tensor  # [B, max_blocks]
    decode: bool = False  # one new token per row, continuing a sequence (recurrent GDN path)
    slot_start: int | None = None  # set when slot_ids are slot_start, slot_start+1, ... (update in place)
    max_row_tokens: int = 1  # > 1 in a decode group: speculative rows (k+1 tokens) are present
    points: StatePoints | None = None  # prefill: GDN states to keep inside rows (prefix snapshots)
    fresh: bool = False  # every row starts its sequence (no tokens in the cache before this step's)
    _phases: list | None = None  # point_phases(), made once per step

    def point_phases(self) -> list[tuple[torch.Tensor, tuple, list[tuple[int, int]]]]:
        """This prefill group's rows cut at their state points, as `ForwardBatch.gdn_row_phases`
        cuts the step's, over the group's own tokens (the recurrent GDN prefill of batch-invariant
        mode on CUDA). Made on first use and kept for the step's layers."""
        if self._phases is None:
            assert self.points is not None
            pts = self.points
            ptr, offs, dest = pts.ptr.tolist(), pts.offsets.tolist(), pts.dest.tolist()
            cuts = [[(offs[m], dest[m]) for m in range(ptr[b], ptr[b + 1])] for b in range(len(ptr) - 1)]
            rows = (self.cu_seqlens.tolist(), self.slot_ids.tolist(), self.has_initial_state.tolist())
            self._phases = _phases(*rows, cuts, self.cu_seqlens.device)
        return self._phases

    @property
    def num_rows(self) -> int:
        return self.slot_ids.numel()

    @property
    def num_tokens(self) -> int:
        return self.tok_end - self.tok_start


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat KV slot (block * block_size + offset) of each token
    decode: RowGroup | None
    prefill: RowGroup | None
    logits_indices: torch.Tensor  # [R] token indices whose next-token logits are wanted
    # images: 3-D rotary positions [3, T] when a row has them (else `positions` on every axis), and
    # (token indices [K], embeddings [K, hidden]) replacing those tokens' embeddings
    rope_positions: torch.Tensor | None = None
    image_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    _rows: tuple | None = None  # gdn_rows(), made once per step
    _pre_rows: tuple | None = None  # prefill_gdn_rows(), made once per step
    _tok_rows: tuple | None = None  # decode_token_rows(), made once per step
    _step_rows: tuple | None = None  # step_token_rows(), made once per step
    _points: tuple | None = None  # gdn_row_points(), made once per step
    _phases: list | None = None  # gdn_row_phases(), made once per step

    @property
    def groups(self) -> list[RowGroup]:
        return [g for g in (self.decode, self.prefill) if g is not None]

    def prefill_gdn_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`gdn_rows()` of the prefill group alone, over its own tokens (a step whose decode rows
        carry drafts runs them through gdn_verify apart). Made on first use and kept."""
        if self._pre_rows is None:
            assert self.prefill is not None
            self._pre_rows = _gdn_rows_of([self.prefill])
        return self._pre_rows

    def gdn_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row of the step, decode then prefill, for the C GDN op (kernels/cpu_ops.py
        gdn_rows): (row_cu [R+1] over the whole step's tokens, row_slots [R], row_init [R] bool,
        tok_slots [T] the slot of each token). Made on first use and kept for the step's layers."""
        if self._rows is None:
            self._rows = _gdn_rows_of(self.groups)
        return self._rows

    def gdn_row_points(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefill rows' state points over gdn_rows()' rows (decode rows first, with none), for
        cpu_ops.gdn_rows_points: (pt_ptr [R+1], pt_off [M], pt_dest [M]). Made on first use and kept."""
        if self._points is None:
            assert self.prefill is not None and self.prefill.points is not None
            pts = self.prefill.points
            n_dec = self.decode.num_rows if self.decode is not None else 0
            ptr = pts.ptr if not n_dec else torch.cat([pts.ptr.new_zeros(n_dec), pts.ptr])
            self._points = (ptr, pts.offsets, pts.dest)
        return self._points

    def gdn_row_phases(self) -> list[tuple[torch.Tensor, tuple, list[tuple[int, int]]]]:
        """gdn_rows() cut at the prefill rows' state points (prefix snapshots inside rows): phase i
        runs every row's tokens up to its i-th point (from where phase i - 1 stopped), so the
        slot holds the state at that point when the phase ends. Per phase: (token indices,
        (row_cu, row_slots, row_init, tok_slots) over those tokens, [(slot, snapshot entry)] to
        copy after it). Made on first use and kept for the step's layers."""
        if self._phases is None:
            cu, slots, init, _ = (t.tolist() for t in self.gdn_rows())
            n_dec = self.decode.num_rows if self.decode is not None else 0
            assert self.prefill is not None and self.prefill.points is not None
            pts = self.prefill.points
            ptr, offs, dest = pts.ptr.tolist(), pts.offsets.tolist(), pts.dest.tolist()
            cuts: list[list[tuple[int, int]]] = [[] for _ in slots]
            for b in range(len(ptr) - 1):
                cuts[n_dec + b] = [(offs[m], dest[m]) for m in range(ptr[b], ptr[b + 1])]
            self._phases = _phases(cu, slots, init, cuts, self.input_ids.device)
        return self._phases

    def decode_token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode group token by token, for the C attention op when its rows carry several
        tokens (drafts): (block table row [T, max_blocks], context length [T]: position + 1) of
        each token. Made on first use and kept for the step's layers."""
        if self._tok_rows is None:
            g = self.decode
            lens = g.cu_seqlens[1:] - g.cu_seqlens[:-1]
            self._tok_rows = (
                g.block_tables.repeat_interleave(lens, dim=0),
                self.positions[g.tok_start : g.tok_end] + 1,
            )
        return self._tok_rows

    def step_token_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every token of the step as a row of its own, for the C attention op in batch-invariant
        mode (each token attends exactly as a decode step's would): (block table row [T, width],
        context length [T]: position + 1, row boundaries [R+1] of the step's sequences). Made on
        first use and kept for the step's layers."""
        if self._step_rows is None:
            g = self.groups
            width = max(x.block_tables.shape[1] for x in g)
            tables = torch.cat(
                [
                    F.pad(x.block_tables, (0, width - x.block_tables.shape[1])).repeat_interleave(
                        x.cu_seqlens[1:] - x.cu_seqlens[:-1], dim=0
                    )
                    for x in g
                ]
            )
            self._step_rows = (tables, self.positions + 1, self.gdn_rows()[0])
        return self._step_rows


def _phases(cu: list, slots: list, init: list, cuts: list[list[tuple[int, int]]], device) -> list:
    """Rows (cu over their tokens, slots, init) cut at points (cuts[r]: (offset, dest) ascending):
    phase i runs every row's tokens up to its i-th point (from where phase i - 1 stopped). Per
    phase: (token indices, (row_cu, row_slots, row_init, tok_slots) over those tokens,
    [(slot, snapshot entry)] to copy after it)."""
    done = [0] * len(slots)
    phases = []
    for ph in range(1 + max(len(c) for c in cuts)):
        idx, rcu, rslots, rinit, tslots, copies = [], [0], [], [], [], []
        for r, (s, c) in enumerate(zip(slots, cuts)):
            if ph > len(c):
                continue  # the row ended in an earlier phase
            end = c[ph][0] if ph < len(c) else cu[r + 1] - cu[r]
            idx += range(cu[r] + done[r], cu[r] + end)
            tslots += [s] * (end - done[r])
            rcu.append(len(idx))
            rslots.append(s)
            rinit.append(bool(init[r]) or done[r] > 0)
            if ph < len(c):
                copies.append((s, c[ph][1]))
            done[r] = end
        i64 = dict(dtype=torch.int64, device=device)
        rows = (
            torch.tensor(rcu, **i64),
            torch.tensor(rslots, **i64),
            torch.tensor(rinit, dtype=torch.bool, device=device),
        )
        phases.append((torch.tensor(idx, **i64), (*rows, torch.tensor(tslots, **i64)), copies))
    return phases


def _gdn_rows_of(groups: list[RowGroup]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_cu, row_slots, row_init, tok_slots) of these groups' rows, in order, over their tokens."""
    g = groups
    cu = g[0].cu_seqlens if len(g) == 1 else torch.cat([g[0].cu_seqlens, g[1].cu_seqlens[1:] + g[0].num_tokens])
    slots = g[0].slot_ids if len(g) == 1 else torch.cat([g[0].slot_ids, g[1].slot_ids])
    init = torch.cat([x.has_initial_state for x in g]) if len(g) > 1 else g[0].has_initial_state
    return cu, slots, init, torch.repeat_interleave(slots, cu[1:] - cu[:-1])


class IntPack:
    """Int lists collected for one step, then made into ONE int64 tensor whose slices are the
    step's index tensors (a tensor creation costs more than the copy on the CPU)."""

    def __init__(self):
        self.vals: list[int] = []
        self._spans: list[tuple[int, int]] = []
        self._tensor: torch.Tensor | None = None

    def add(self, xs) -> int:
        self._spans.append((len(self.vals), len(xs)))
        self.vals.extend(xs)
        return len(self._spans) - 1

    def build(self, device) -> None:
        self._tensor = torch.tensor(self.vals, dtype=torch.int64, device=device)

    def __getitem__(self, i: int) -> torch.Tensor:
        start, n = self._spans[i]
        return self._tensor[start : start + n]


def group_fields(pack: IntPack, lens, slots, start_pos, block_tables, table: torch.Tensor | None = None) -> dict:
    """Adds a group's index lists to `pack`; `make_group` reads them back once it is built.
    table: the group's page tables already made (engine/block_tables.py), int64 [rows, width]
    on the step's device; else they are flattened from block_tables' lists."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    if table is not None:
        width, packed = table.shape[1], None
    else:
        width = max(len(b) for b in block_tables)
        packed = pack.add([x for b in block_tables for x in (b + [0] * (width - len(b)))])
    return dict(
        cu=pack.add(cu),
        slots=pack.add(slots),
        start_pos=pack.add(start_pos),
        seq_lens=pack.add([p + n for p, n in zip(start_pos, lens)]),
        table=packed,
        table_tensor=table,
        width=width,
        num_tokens=cu[-1],
        max_row_tokens=max(lens),
        slot_start=slots[0] if list(slots) == list(range(slots[0], slots[0] + len(slots))) else None,
        fresh=not any(start_pos),
    )


def make_group(tok_start: int, pack: IntPack, f: dict, decode: bool = False) -> RowGroup:
    return RowGroup(
        tok_start=tok_start,
        tok_end=tok_start + f["num_tokens"],
        cu_seqlens=pack[f["cu"]],
        slot_ids=pack[f["slots"]],
        has_initial_state=pack[f["start_pos"]] > 0,
        seq_lens=pack[f["seq_lens"]],
        block_tables=pack[f["table"]].view(-1, f["width"]) if f["table"] is not None else f["table_tensor"],
        decode=decode,
        max_row_tokens=f["max_row_tokens"],
        slot_start=f["slot_start"],
        fresh=f["fresh"],
    )
