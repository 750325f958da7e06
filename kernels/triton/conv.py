"""Depthwise causal conv1d with slot-indexed state, Triton, with kernels.conv's contract: one
program per (row, block of channels) walks the row in tiles, reading each tap from the new inputs
or the old state; one kernel serves prefill, decode and rows of k+1 tokens (docs/kernels.md)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_conv_inputs
from kernels.triton._common import (
    check_flags,
    check_index,
    check_last_contiguous,
    check_out,
    check_same_device,
    row_lengths,
)

__all__ = ["causal_conv1d_triton", "causal_conv1d_update_triton"]


@triton.jit
def _ext_tile(x_ptr, st_ptrs, start, pos, valid, state_lo, s_xt, rd, md, KC: tl.constexpr):
    """ext values at row-relative positions `pos` (< 0: old state column KC-1+pos) for channels
    rd, as a [len(pos), BD] float32 tile; zero where not `valid`, and where pos < state_lo
    (state_lo = 0 for a row without initial state: it never reads the slot)."""
    from_x = pos >= 0
    xv = tl.load(
        x_ptr + (start + pos)[:, None] * s_xt + rd[None, :],
        mask=(valid & from_x)[:, None] & md[None, :],
        other=0.0,
    )
    sv = tl.load(
        st_ptrs[None, :] + (KC - 1 + pos)[:, None],
        mask=(valid & (pos < 0) & (pos >= state_lo))[:, None] & md[None, :],
        other=0.0,
    )
    return xv.to(tl.float32) + sv.to(tl.float32)


@triton.jit
def _conv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    cu_ptr,
    slot_ptr,
    init_ptr,
    pool_ptr,
    inter_ptr,
    s_xt,
    s_yt,
    s_wd,
    s_wk,
    s_ps,
    s_pd,
    s_ib,
    s_it,
    s_id,
    D,
    KC: tl.constexpr,
    KP: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_INTER: tl.constexpr,
    ACT: tl.constexpr,
):
    b = tl.program_id(0)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    md = rd < D
    start = tl.load(cu_ptr + b).to(tl.int64)
    L = tl.load(cu_ptr + b + 1).to(tl.int64) - start
    slot = tl.load(slot_ptr + b).to(tl.int64)
    # Positions >= state_lo are readable; the old state sits at -(KC-1)..-1.
    state_lo = -(KC - 1)
    if HAS_INIT:
        state_lo = tl.where(tl.load(init_ptr + b).to(tl.int32) != 0, -(KC - 1), 0)
    st_ptrs = pool_ptr + slot * s_ps + rd * s_pd  # [BD]; column c at + c
    i_ptrs = inter_ptr + b.to(tl.int64) * s_ib + rd * s_id  # [BD]

    rt = tl.arange(0, BT)
    for t0 in range(0, L, BT):
        t = t0 + rt
        mt = t < L
        acc = tl.zeros((BT, BD), dtype=tl.float32)
        for j in tl.static_range(KC):
            w = tl.load(w_ptr + rd * s_wd + j * s_wk, mask=md, other=0.0).to(tl.float32)
            acc += _ext_tile(x_ptr, st_ptrs, start, t + j - (KC - 1), mt, state_lo, s_xt, rd, md, KC) * w[None, :]
        if ACT:
            acc = acc * tl.sigmoid(acc)
        tl.store(
            y_ptr + (start + t)[:, None] * s_yt + rd[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=mt[:, None] & md[None, :],
        )
        if HAS_INTER:  # state after token t: ext[t + 1 : t + KC]
            for c in tl.static_range(KC - 1):
                snap = _ext_tile(x_ptr, st_ptrs, start, t + 1 + c - (KC - 1), mt, state_lo, s_xt, rd, md, KC)
                tl.store(
                    i_ptrs[None, :] + t[:, None] * s_it + c,
                    snap.to(inter_ptr.dtype.element_ty),
                    mask=mt[:, None] & md[None, :],
                )

    # New state: ext[L : L + KC-1], gathered before any write to the slot.
    rc = tl.arange(0, KP)
    new = _ext_tile(x_ptr, st_ptrs, start, L + rc - (KC - 1), rc < KC - 1, state_lo, s_xt, rd, md, KC)
    tl.debug_barrier()
    tl.store(
        st_ptrs[None, :] + rc[:, None], new.to(pool_ptr.dtype.element_ty), mask=(rc < KC - 1)[:, None] & md[None, :]
    )


def _launch(x, weight, cu_seqlens, conv_pool, slot_ids, has_initial_state, activation, inter, out):
    D, kc = weight.shape
    B = cu_seqlens.numel() - 1
    y = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    BD = min(triton.next_power_of_2(D), 128)
    KP = triton.next_power_of_2(max(kc - 1, 1))
    init = has_initial_state if has_initial_state is not None else slot_ids
    inter_arg = inter if inter is not None else conv_pool
    i_strides = (inter.stride(0), inter.stride(1), inter.stride(2)) if inter is not None else (0, 0, 0)
    grid = (B, triton.cdiv(D, BD))
    _conv_kernel[grid](
        x,
        weight,
        y,
        cu_seqlens,
        slot_ids,
        init,
        conv_pool,
        inter_arg,
        x.stride(0),
        y.stride(0),
        weight.stride(0),
        weight.stride(1),
        conv_pool.stride(0),
        conv_pool.stride(1),
        *i_strides,
        D,
        KC=kc,
        KP=KP,
        BT=16,
        BD=BD,
        HAS_INIT=has_initial_state is not None,
        HAS_INTER=inter is not None,
        ACT=bool(activation),
    )
    return y


def _check(x, weight, cu_seqlens, conv_pool, slot_ids, inter, out, n_max):
    check_index(cu_seqlens=cu_seqlens, slot_ids=slot_ids)
    check_last_contiguous(x=x)
    check_same_device(x=x, weight=weight, cu_seqlens=cu_seqlens, conv_pool=conv_pool, slot_ids=slot_ids)
    D, kc = weight.shape
    B = slot_ids.numel()
    if kc < 2:
        raise ValueError(f"weight must be [D, Kc] with Kc >= 2 (got {tuple(weight.shape)})")
    if inter is not None and (
        inter.dim() != 4
        or inter.shape[0] != B
        or inter.shape[1] < n_max
        or tuple(inter.shape[2:]) != (D, kc - 1)
        or inter.stride(-1) != 1
        or inter.device != x.device
    ):
        raise ValueError(
            f"intermediate_states must be [B={B}, n>={n_max}, D={D}, Kc-1={kc - 1}] with unit stride in time "
            f"(got {tuple(inter.shape)} strides {inter.stride()})"
        )
    check_out(out, tuple(x.shape), x.dtype, x.device)


def causal_conv1d_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    activation: bool = True,
    intermediate_states: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Triton causal_conv1d (see kernels.conv): varlen prefill or decode rows of 1..k+1 tokens.
    Returns y [T, D] in x's dtype (into `out` when given); slot_ids must be distinct. max_len:
    the longest row, when the caller knows it (kernels/checks.py: no read back from the device)."""
    check_conv_inputs(x, weight, cu_seqlens, conv_pool, slot_ids, max_len)
    B = cu_seqlens.numel() - 1
    check_flags("has_initial_state", has_initial_state, B)
    n_max = max(row_lengths(cu_seqlens)) if max_len is None else max_len
    _check(x, weight, cu_seqlens, conv_pool, slot_ids, intermediate_states, out, n_max)
    return _launch(x, weight, cu_seqlens, conv_pool, slot_ids, has_initial_state, activation, intermediate_states, out)


def causal_conv1d_update_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    activation: bool = True,
    intermediate_states: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton causal_conv1d_update (see kernels.conv): x [B, D], one token per row."""
    B = x.shape[0]
    cu = torch.arange(B + 1, device=x.device)
    check_conv_inputs(x, weight, cu, conv_pool, slot_ids, max_len=1)  # cu is built here: nothing to read back
    _check(x, weight, cu, conv_pool, slot_ids, intermediate_states, out, 1)
    return _launch(x, weight, cu, conv_pool, slot_ids, None, activation, intermediate_states, out)
