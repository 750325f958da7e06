"""A staged decode batch (engine/model/graphs.py) against the worker's general one, field by field."""

from __future__ import annotations

import torch


def assert_same_decode_batch(general, staged) -> None:
    """Each field of `staged` (its page tables spread by `_Buffers.expand`, wider than the
    general batch's) equals the general batch's."""
    for f in ("input_ids", "positions", "slot_mapping", "logits_indices"):
        assert torch.equal(getattr(general, f), getattr(staged, f)), f
    for f in ("cu_seqlens", "slot_ids", "has_initial_state", "seq_lens"):
        assert torch.equal(getattr(general.decode, f), getattr(staged.decode, f)), f
    width = general.decode.block_tables.shape[1]
    assert torch.equal(general.decode.block_tables, staged.decode.block_tables[:, :width])
