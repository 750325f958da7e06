"""Partial rotary embedding (rotate-half form) on the first `rotary_dim` dims of each head."""

from __future__ import annotations

import torch


class Rotary:
    def __init__(self, rotary_dim: int, theta: float, max_positions: int, dtype: torch.dtype, device="cpu"):
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype).to(device)  # [P, rotary_dim]
        self.sin = emb.sin().to(dtype).to(device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [T, 1, rd]


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, hd], in place: rotate the first rotary_dim dims (rotate-half form), keep the rest."""
    rd = cos.shape[-1]
    half = rd // 2
    xr = x[..., :rd]
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    xr.mul_(cos).add_(rot.mul_(sin))  # two roundings in bfloat16, as transformers does
    return x
