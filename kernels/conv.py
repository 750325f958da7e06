"""Depthwise causal conv1d over the GDN [q | k | v] channels with slot-indexed state, PyTorch path:
`x [T, D]`, `weight [D, Kc]`, `conv_pool [S, D, Kc-1]`, optionally keeping the state at points
inside a sequence (docs/kernels.md, "Module notes")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import check_conv_inputs
from kernels.gdn import pad_packed, unpad_packed
from kernels.points import StatePoints, check_points
from kernels.triton import force_triton as _force_triton

__all__ = ["causal_conv1d", "causal_conv1d_update", "conv_update_"]


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    activation: bool = True,
    intermediate_states: torch.Tensor | None = None,
    points: StatePoints | None = None,
    points_pool: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Variable-length causal conv (prefill, or decode rows of several tokens).

    intermediate_states, when given, is [B, n_max, D, Kc-1] and receives the conv state after
    every token of each row (for speculative rollback). points, when given, name states inside
    the sequences to write into points_pool [N, D, Kc-1]. Returns y [T, D] in x's dtype.
    max_len: the longest row, when the caller knows it on the host (the Triton path then reads
    nothing back, kernels/checks.py).
    """
    if points is not None:
        conv_states_at(x, weight, cu_seqlens, conv_pool, slot_ids, has_initial_state, points, points_pool)
    if x.is_cuda or _force_triton():
        from kernels.triton.conv import causal_conv1d_triton

        args = (x, weight, cu_seqlens, conv_pool, slot_ids, has_initial_state, activation, intermediate_states)
        return causal_conv1d_triton(*args, max_len=max_len)
    check_conv_inputs(x, weight, cu_seqlens, conv_pool, slot_ids)
    D, kc = weight.shape
    B = cu_seqlens.numel() - 1
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    L = int(lens.max())
    state = conv_pool.index_select(0, slot_ids).float()  # [B, D, Kc-1]
    if has_initial_state is not None:
        state = torch.where(has_initial_state[:, None, None], state, torch.zeros((), device=x.device))
    xp = pad_packed(x.float(), cu_seqlens, L).transpose(1, 2)  # [B, D, L]
    ext = torch.cat([state, xp], dim=-1)  # [B, D, Kc-1+L]
    w = weight.float()
    y = ext[:, :, :L] * w[:, :1]  # [B, D, L]: Kc shifted multiply-adds (faster than a depthwise conv1d on CPU)
    for j in range(1, kc):
        y.addcmul_(ext[:, :, j : j + L], w[:, j : j + 1])
    if x.dtype != torch.float32:
        y = y.to(x.dtype).float()  # the conv's output is rounded before the activation, as transformers does
    if activation:
        F.silu(y, inplace=True)

    # New state: ext[:, :, len_b : len_b + Kc-1] for each row.
    cols = lens[:, None] + torch.arange(kc - 1, device=x.device)[None, :]  # [B, Kc-1]
    new_state = ext.gather(2, cols[:, None, :].expand(B, D, kc - 1))
    conv_pool.index_copy_(0, slot_ids, new_state.to(conv_pool.dtype))
    if intermediate_states is not None:
        for t in range(L):
            live = (t < lens)[:, None, None]
            snap = ext[:, :, t + 1 : t + kc]
            intermediate_states[:, t] = torch.where(live, snap.to(intermediate_states.dtype), intermediate_states[:, t])
    return unpad_packed(y.transpose(1, 2), cu_seqlens).to(x.dtype)


def conv_states_at(x, weight, cu_seqlens, conv_pool, slot_ids, has_initial_state, points, points_pool) -> None:
    """points_pool[dest[m]] = the conv state after offsets[m] tokens of sequence seq[m]: ext's
    columns [t, t + Kc-1), from the slot's saved inputs where t < Kc-1 and x elsewhere."""
    check_conv_inputs(x, weight, cu_seqlens, conv_pool, slot_ids)
    kc = weight.shape[1]
    check_points(points, cu_seqlens, points_pool, conv_pool.shape[1:])
    if not points.num_points:
        return
    T, D = x.shape
    B = cu_seqlens.numel() - 1
    init = conv_pool.index_select(0, slot_ids)  # [B, D, Kc-1]
    if has_initial_state is not None:
        init = torch.where(has_initial_state[:, None, None], init, torch.zeros((), dtype=init.dtype, device=x.device))
    src = torch.cat([x.to(points_pool.dtype), init.transpose(1, 2).reshape(B * (kc - 1), D).to(points_pool.dtype)])
    seq = points.seq().to(x.device)
    col = points.offsets.to(x.device)[:, None] + torch.arange(kc - 1, device=x.device)[None, :]  # [M, Kc-1] in ext
    idx = torch.where(col < kc - 1, T + seq[:, None] * (kc - 1) + col, cu_seqlens[seq][:, None] + col - (kc - 1))
    points_pool.index_copy_(0, points.dest.to(points_pool.device), src[idx].transpose(1, 2).contiguous())


def conv_update_(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, activation: bool = True) -> torch.Tensor:
    """One token per row, shifting `state` [B, D, Kc-1] in place (it may be a contiguous run of
    a pool's slots). Returns y [B, D]."""
    # Time-major [B, Kc, D]: the sum over Kc runs along an outer axis, which vectorises over D.
    ext = torch.cat([state.float().transpose(1, 2), x.float()[:, None, :]], dim=1)
    y = (ext * weight.float().t()).sum(1)
    if x.dtype != torch.float32:
        y = y.to(x.dtype).float()  # rounded before the activation, as above
    state.copy_(ext[:, 1:].transpose(1, 2))
    return (F.silu(y, inplace=True) if activation else y).to(x.dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    activation: bool = True,
    intermediate_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per row (plain decode): x [B, D] -> y [B, D]; slots shift left by one."""
    if x.is_cuda or _force_triton():
        from kernels.triton.conv import causal_conv1d_update_triton

        return causal_conv1d_update_triton(x, weight, conv_pool, slot_ids, activation, intermediate_states)
    B = x.shape[0]
    cu = torch.arange(B + 1, device=x.device)
    check_conv_inputs(x, weight, cu, conv_pool, slot_ids)
    state = conv_pool.index_select(0, slot_ids)
    y = conv_update_(x, weight, state, activation)
    conv_pool.index_copy_(0, slot_ids, state)
    if intermediate_states is not None:
        intermediate_states[:, 0] = state.to(intermediate_states.dtype)
    return y
