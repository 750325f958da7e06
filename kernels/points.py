"""StatePoints: states to keep from inside the sequences of a prefill call.

A prefill op (`gdn_chunk_prefill`, `causal_conv1d`) walks whole prompt chunks at once, but a
prefix cache wants the recurrent and conv states at fixed positions inside them (docs/DESIGN.md
§6). Point m asks for the state after the first `offsets[m]` tokens of sequence `seq[m]` of the
call (1 <= offset <= that sequence's length), written into row `dest[m]` of a pool shaped like
the op's state pool. The points of a sequence are contiguous and ascending by offset, so
`ptr` [B+1] (CSR over the call's sequences) says where each sequence's points are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StatePoints", "check_points"]


@dataclass(frozen=True)
class StatePoints:
    ptr: torch.Tensor  # [B+1] int64: sequence b's points are [ptr[b], ptr[b+1])
    offsets: torch.Tensor  # [M] int64, ascending within a sequence
    dest: torch.Tensor  # [M] int64 rows of the destination pool

    @classmethod
    def build(cls, num_seqs: int, points: list[tuple[int, int, int]], device=None) -> StatePoints:
        """From (sequence, offset, dest) triples in any order."""
        points = sorted(points)
        counts = [0] * (num_seqs + 1)
        for b, _, _ in points:
            counts[b + 1] += 1
        for b in range(num_seqs):
            counts[b + 1] += counts[b]
        return cls(
            torch.tensor(counts, dtype=torch.int64, device=device),
            torch.tensor([o for _, o, _ in points], dtype=torch.int64, device=device),
            torch.tensor([d for _, _, d in points], dtype=torch.int64, device=device),
        )

    @property
    def num_points(self) -> int:
        return self.offsets.numel()

    def seq(self) -> torch.Tensor:
        """[M] the sequence of each point."""
        counts = self.ptr[1:] - self.ptr[:-1]
        return torch.repeat_interleave(torch.arange(counts.numel(), device=self.ptr.device), counts)


def check_points(points: StatePoints, cu_seqlens: torch.Tensor, pool: torch.Tensor, state_shape) -> None:
    """Raise ValueError unless `points` fit the call's sequences and `pool` is [N, *state_shape]."""
    B = cu_seqlens.numel() - 1
    if points.ptr.shape != (B + 1,) or points.dest.shape != points.offsets.shape or points.offsets.dim() != 1:
        raise ValueError(
            f"points.ptr must be [B+1={B + 1}] and offsets, dest [M] "
            f"(got {tuple(points.ptr.shape)}, {tuple(points.offsets.shape)}, {tuple(points.dest.shape)})"
        )
    if pool.dim() != len(state_shape) + 1 or tuple(pool.shape[1:]) != tuple(state_shape):
        raise ValueError(f"the points' pool must be [N, {', '.join(map(str, state_shape))}] (got {tuple(pool.shape)})")
    if not points.num_points:
        return
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(points.offsets.device)
    room = lens[points.seq()]
    if bool(((points.offsets < 1) | (points.offsets > room)).any()):
        raise ValueError(f"point offsets must be in 1..their sequence's length (got {points.offsets.tolist()})")
    if bool(((points.dest < 0) | (points.dest >= pool.shape[0])).any()):
        raise ValueError(f"point dest rows must be in 0..{pool.shape[0] - 1} (got {points.dest.tolist()})")
