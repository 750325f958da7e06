"""Fused MoE (the routed experts), Triton, with kernels.moe.fused_moe's contract: (token, expert)
pairs sorted by expert into blocks of one expert, built on the device without a host sync, then
two grouped GEMMs (gate/up with SwiGLU, down with the routing weight); optional FP8 experts
(docs/kernels.md, "Module notes"). Row-invariant (--batch-invariant): one block of rows at every
size and the top-k sum in a fixed order, so a token's bits do not depend on its step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_moe_inputs
from kernels.moe import sort_by_expert
from kernels.triton._common import (
    TL_DTYPES,
    check_last_contiguous,
    check_same_device,
    dot,
    dot_in_f32,
    round_to,
)
from kernels.triton.fp8 import k_tile, weight_tile

__all__ = ["fused_moe_triton", "align_by_expert", "INVARIANT_BM"]

# Rows per block when row-invariant: fixed (a decode step's few rows per expert fill little more)
INVARIANT_BM = 16


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_pair [n_blocks*BM], block_expert [n_blocks]) for topk_ids [T, k] (see the module)."""
    flat = topk_ids.reshape(-1)
    P, dev = flat.numel(), flat.device
    ones = torch.ones(P, dtype=torch.int64, device=dev)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat.long(), ones)
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order].long()
    rank = torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[expert]  # position in the expert's run
    n_blocks = triton.cdiv(P, block_m) + min(num_experts, P)
    slot_pair = torch.full((n_blocks * block_m,), P, dtype=torch.int64, device=dev)
    slot_pair[(block_end - blocks)[expert] * block_m + rank] = order
    block_expert = torch.searchsorted(block_end, torch.arange(n_blocks, device=dev), right=True)
    return slot_pair, block_expert


@triton.jit
def _program_tile(slot_pair_ptr, block_expert_ptr, P, N, BM: tl.constexpr, BN: tl.constexpr):
    """This program's (expert, row slots [BM], pairs [BM], valid rows [BM], output columns
    [BN], valid columns [BN])."""
    m = tl.program_id(0)
    slots = m * BM + tl.arange(0, BM)
    pair = tl.load(slot_pair_ptr + slots)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    return tl.load(block_expert_ptr + m), slots, pair, pair < P, rn, rn < N


@triton.jit
def _expert_rows(w_ptr, s_ptr, e, rows, s_we, s_wn, s_se, s_sn, QN):
    """Pointers [BN, 1] to rows `rows` of expert e's weight and to their rows of scales."""
    return w_ptr + e * s_we + rows.to(tl.int64)[:, None] * s_wn, s_ptr + e * s_se + (rows // QN)[:, None] * s_sn


@triton.jit
def _moe_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    slot_pair_ptr,
    block_expert_ptr,
    a_ptr,
    P,
    E,
    I,
    H,
    TOPK,
    s_x,
    s_we,
    s_wn,
    s_se,
    s_sn,
    s_a,
    QN,
    QK,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SCALED: tl.constexpr,
    ALIGNED: tl.constexpr,
    XDT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    expert, slots, pair, valid, rn, n_in = _program_tile(slot_pair_ptr, block_expert_ptr, P, I, BM, BN)
    if expert < E:
        e = expert.to(tl.int64)
        rk = tl.arange(0, BK)
        x_rows = x_ptr + (pair // TOPK).to(tl.int64)[:, None] * s_x
        g_rows, gs_rows = _expert_rows(w_ptr, s_ptr, e, rn, s_we, s_wn, s_se, s_sn, QN)
        u_rows, us_rows = _expert_rows(w_ptr, s_ptr, e, rn + I, s_we, s_wn, s_se, s_sn, QN)
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + rk
            k_in = kk < H
            xt = tl.load(x_rows + kk[None, :], mask=valid[:, None] & k_in[None, :], other=0.0)
            wg = weight_tile(g_rows, gs_rows, kk, k0, n_in, k_in, QK, SCALED, ALIGNED, XDT)
            wu = weight_tile(u_rows, us_rows, kk, k0, n_in, k_in, QK, SCALED, ALIGNED, XDT)
            acc_g += dot(xt, tl.trans(wg), DOT_F32)
            acc_u += dot(xt, tl.trans(wu), DOT_F32)
        g = round_to(acc_g, XDT)
        act = round_to(round_to(g * tl.sigmoid(g), XDT) * round_to(acc_u, XDT), XDT)
        a = a_ptr + slots.to(tl.int64)[:, None] * s_a + rn[None, :]
        tl.store(a, act.to(a_ptr.dtype.element_ty), mask=valid[:, None] & n_in[None, :])


@triton.jit
def _moe_down_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    slot_pair_ptr,
    block_expert_ptr,
    tw_ptr,
    out_ptr,
    P,
    E,
    H,
    I,
    s_a,
    s_we,
    s_wn,
    s_se,
    s_sn,
    s_o,
    QN,
    QK,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SCALED: tl.constexpr,
    ALIGNED: tl.constexpr,
    XDT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    expert, slots, pair, valid, rn, n_in = _program_tile(slot_pair_ptr, block_expert_ptr, P, H, BM, BN)
    if expert < E:
        e = expert.to(tl.int64)
        rk = tl.arange(0, BK)
        a_rows = a_ptr + slots.to(tl.int64)[:, None] * s_a
        w_rows, ws_rows = _expert_rows(w_ptr, s_ptr, e, rn, s_we, s_wn, s_se, s_sn, QN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, BK):
            kk = k0 + rk
            k_in = kk < I
            at = tl.load(a_rows + kk[None, :], mask=valid[:, None] & k_in[None, :], other=0.0)
            wt = weight_tile(w_rows, ws_rows, kk, k0, n_in, k_in, QK, SCALED, ALIGNED, XDT)
            acc += dot(at, tl.trans(wt), DOT_F32)
        w_pair = round_to(tl.load(tw_ptr + pair, mask=valid, other=0.0).to(tl.float32), XDT)
        out = out_ptr + pair.to(tl.int64)[:, None] * s_o + rn[None, :]
        tl.store(out, round_to(acc, XDT) * w_pair[:, None], mask=valid[:, None] & n_in[None, :])


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    row_invariant: bool = False,
) -> torch.Tensor:
    """Triton fused_moe (see kernels.moe and the module). Returns [T, H] in x's dtype. Expert ids
    outside [0, E) are refused for CPU tensors (one host sync); on CUDA they are not checked.
    row_invariant: every block INVARIANT_BM rows (else chosen from the average expert's rows),
    the k experts' outputs added in order."""
    check_moe_inputs(x, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv, block_size)
    if x.dtype not in TL_DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16 (got x={tuple(x.shape)}:{x.dtype})")
    check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    check_last_contiguous(x=x, w13=w13, w2=w2)
    T, H = x.shape
    E, I, k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    P = T * k
    if not x.is_cuda and P:
        sort_by_expert(topk_ids, E)  # range check
    if P == 0:
        return torch.zeros_like(x)
    scaled = w13_scale_inv is not None
    if scaled:
        check_same_device(x=x, w13_scale_inv=w13_scale_inv, w2_scale_inv=w2_scale_inv)
        check_last_contiguous(w13_scale_inv=w13_scale_inv, w2_scale_inv=w2_scale_inv)
        (qn, qk), (BK, aligned) = block_size, k_tile(block_size[1])
        s13, s2 = w13_scale_inv, w2_scale_inv
    else:  # the scale pointers are never read
        qn, qk, BK, aligned = 1, 1, 64, True
        s13 = s2 = x.new_empty((1, 1, 1), dtype=torch.float32)
    # Rows per block: enough for the average expert's run, at least tl.dot's 16.
    BM = INVARIANT_BM if row_invariant else min(64, max(16, triton.next_power_of_2(-(-P // min(E, P)))))
    BN = 64
    slot_pair, block_expert = align_by_expert(topk_ids, E, BM)
    n_blocks = block_expert.numel()
    common = dict(
        BM=BM, BN=BN, BK=BK, SCALED=scaled, ALIGNED=aligned, XDT=TL_DTYPES[x.dtype], DOT_F32=dot_in_f32(x.dtype)
    )
    a = torch.empty((n_blocks * BM, I), dtype=x.dtype, device=x.device)
    _moe_up_kernel[(n_blocks, triton.cdiv(I, BN))](
        x,
        w13,
        s13,
        slot_pair,
        block_expert,
        a,
        P,
        E,
        I,
        H,
        k,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        a.stride(0),
        qn,
        qk,
        **common,
    )
    out = torch.empty((P, H), dtype=torch.float32, device=x.device)
    tw = topk_weights.reshape(-1).contiguous()
    _moe_down_kernel[(n_blocks, triton.cdiv(H, BN))](
        a,
        w2,
        s2,
        slot_pair,
        block_expert,
        tw,
        out,
        P,
        E,
        H,
        I,
        a.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        out.stride(0),
        qn,
        qk,
        **common,
    )
    if row_invariant:  # elementwise adds in a fixed order (a reduction's may change with the shape)
        per = out.view(T, k, H).unbind(1)
        acc = per[0].clone()
        for o in per[1:]:
            acc += o
        return acc.to(x.dtype)
    return out.view(T, k, H).sum(1).to(x.dtype)
