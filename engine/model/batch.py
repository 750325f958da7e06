"""ForwardBatch: the tensors of one model step, built by a worker from a `StepInput`.

Tokens are packed; rows (one per scheduled request) are ordered decode rows first (one new
token each, recurrent GDN path) then prefill rows (a prompt chunk each, chunked GDN path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def groups(self) -> list[RowGroup]:
        return [g for g in (self.decode, self.prefill) if g is not None]


def make_group(tok_start, lens, slots, has_init, seq_lens, block_tables, device, decode=False) -> RowGroup:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    width = max(len(b) for b in block_tables)
    table = [b + [0] * (width - len(b)) for b in block_tables]
    return RowGroup(
        tok_start=tok_start,
        tok_end=tok_start + cu[-1],
        cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=device),
        slot_ids=torch.tensor(slots, dtype=torch.int64, device=device),
        has_initial_state=torch.tensor(has_init, dtype=torch.bool, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        block_tables=torch.tensor(table, dtype=torch.int64, device=device),
        decode=decode,
        max_row_tokens=max(lens),
        slot_start=slots[0] if list(slots) == list(range(slots[0], slots[0] + len(slots))) else None,
    )
