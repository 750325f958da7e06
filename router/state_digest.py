"""Which prefill nodes' state a decode node can take, by the schema digests the nodes report: the
router's copy of transfer.schema.feeds (the router imports no torch, so not the transfer package);
tests/transfer/test_recurrent_cast.py holds the two to the same answers."""

from __future__ import annotations


def feeds(src: str, dst: str) -> bool:
    """Whether a prefill node of schema digest `src` can hand its state to a decode node of digest
    `dst`: the same digest, or a float32 recurrent state feeding a bfloat16 one (the digest of a
    bfloat16 state ends in "+bfloat16"; the one cast a transfer plan declares)."""
    return src == dst or ("+" not in src and dst == f"{src}+bfloat16")
