"""Partial rotary embedding (rotate-half form) on the first `rotary_dim` dims of each head, with
the checkpoint's position scaling (engine/rope.py)."""

from __future__ import annotations

import torch

from engine.rope import NO_SCALING, RopeScaling


class Rotary:
    def __init__(
        self,
        rotary_dim: int,
        theta: float,
        max_positions: int,
        dtype: torch.dtype,
        device="cpu",
        scaling: RopeScaling = NO_SCALING,
    ):
        self.rotary_dim = rotary_dim
        inv_freq = scaling.inv_freq(rotary_dim, theta)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        att = scaling.attention_factor  # YaRN's scale of cos and sin (1 otherwise), in float32 first
        self.cos = (emb.cos() * att).to(dtype).to(device)  # [P, rotary_dim]
        self.sin = (emb.sin() * att).to(dtype).to(device)

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


def mrope_axes(rotary_dim: int, section: tuple[int, int, int]) -> torch.Tensor:
    """[rotary_dim] the axis (0 t, 1 h, 2 w) each rotary column turns with: Qwen3.5's interleaved
    `mrope_section` (engine/vision/positions.py), the same for both halves (rotate-half form)."""
    half = rotary_dim // 2
    axes = torch.zeros(half, dtype=torch.int64)
    for j in range(half):
        if j % 3 == 1 and j < 3 * section[1]:
            axes[j] = 1
        elif j % 3 == 2 and j < 3 * section[2]:
            axes[j] = 2
    return torch.cat([axes, axes])


def mrope_cos_sin(rot: Rotary, positions: torch.Tensor, axes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, rotary_dim] for 3-D positions [3, T]: each column from its axis' position."""
    idx = axes.to(positions.device)[None, :].expand(positions.shape[1], -1)[None]  # [1, T, rd]
    cos = rot.cos[positions].gather(0, idx)[0]
    sin = rot.sin[positions].gather(0, idx)[0]
    return cos[:, None, :], sin[:, None, :]
