"""Token-by-token gated delta rule for decode rows of 1..n tokens, Triton, with
kernels.gdn.gdn_recurrent's contract: one program per (row, value head, dv block) keeps the state
in registers, optionally writing the state after every token for rollback (docs/kernels.md)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_gdn_inputs
from kernels.triton._common import (
    check_flags,
    check_index,
    check_last_contiguous,
    check_out,
    check_same_device,
    pow2,
    row_lengths,
    token_strides,
)

__all__ = ["gdn_recurrent_triton"]


@triton.jit
def _gdn_recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    o_ptr,
    cu_ptr,
    slot_ptr,
    init_ptr,
    pool_ptr,
    inter_ptr,
    s_qt,
    s_qh,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_gt,
    s_gh,
    s_bt,
    s_bh,
    s_ot,
    s_oh,
    s_ps,
    s_ph,
    s_pk,
    s_pv,
    s_ib,
    s_it,
    s_ih,
    s_ik,
    s_iv,
    scale,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_INTER: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)

    rk = tl.arange(0, BK)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    mk = rk < DK
    mv = rv < DV
    s_mask = mk[:, None] & mv[None, :]
    s_ptrs = pool_ptr + slot * s_ps + h * s_ph + rk[:, None] * s_pk + rv[None, :] * s_pv
    S = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)  # float32 or bfloat16 pool
    if HAS_INIT:
        S = tl.where(tl.load(init_ptr + b) != 0, S, 0.0)  # a never-written slot may hold NaN
    i_ptrs = inter_ptr + b.to(tl.int64) * s_ib + h * s_ih + rk[:, None] * s_ik + rv[None, :] * s_iv

    for t in range(start, end):
        kt = tl.load(k_ptr + t * s_kt + hk * s_kh + rk, mask=mk, other=0.0).to(tl.float32)
        qt = tl.load(q_ptr + t * s_qt + hk * s_qh + rk, mask=mk, other=0.0).to(tl.float32) * scale
        vt = tl.load(v_ptr + t * s_vt + h * s_vh + rv, mask=mv, other=0.0).to(tl.float32)
        gt = tl.load(g_ptr + t * s_gt + h * s_gh).to(tl.float32)
        bt = tl.load(beta_ptr + t * s_bt + h * s_bh).to(tl.float32)
        S = S * tl.exp(gt)
        delta = (vt - tl.sum(S * kt[:, None], 0)) * bt
        S = S + kt[:, None] * delta[None, :]
        ot = tl.sum(S * qt[:, None], 0)
        tl.store(o_ptr + t * s_ot + h * s_oh + rv, ot.to(o_ptr.dtype.element_ty), mask=mv)
        if HAS_INTER:
            tl.store(i_ptrs + (t - start) * s_it, S.to(inter_ptr.dtype.element_ty), mask=s_mask)

    tl.store(s_ptrs, S.to(pool_ptr.dtype.element_ty), mask=s_mask)


def gdn_recurrent_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    intermediate_states: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Triton gdn_recurrent (see kernels.gdn). `out` [T, Hv, dv] in v's dtype, if given,
    receives o. slot_ids must be distinct. max_len: the longest row, when the caller knows it
    (kernels/checks.py: no read back from the device)."""
    check_gdn_inputs(q, k, v, g, beta, cu_seqlens, state_pool, slot_ids, max_len)
    check_index(cu_seqlens=cu_seqlens, slot_ids=slot_ids)
    check_last_contiguous(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, state_pool=state_pool, slot_ids=slot_ids)
    B = cu_seqlens.numel() - 1
    check_flags("has_initial_state", has_initial_state, B)
    T, hv, dv = v.shape
    hk, dk = q.shape[1:]
    inter = intermediate_states
    if inter is not None:
        n_max = max(row_lengths(cu_seqlens)) if max_len is None else max_len
        if (
            inter.dim() != 5
            or inter.shape[0] != B
            or inter.shape[1] < n_max
            or tuple(inter.shape[2:]) != (hv, dk, dv)
            or inter.dtype != state_pool.dtype
            or inter.device != v.device
        ):
            raise ValueError(
                f"intermediate_states must be {str(state_pool.dtype).removeprefix('torch.')} [B={B}, n>={n_max}, Hv={hv}, dk={dk}, dv={dv}] "
                f"(got {tuple(inter.shape)}:{str(inter.dtype).removeprefix('torch.')})"
            )
    check_out(out, (T, hv, dv), v.dtype, v.device)
    o = torch.empty_like(v, memory_format=torch.contiguous_format) if out is None else out
    scale = dk**-0.5 if scale is None else scale
    BK = pow2(dk)
    BV = min(pow2(dv), 32)
    init = has_initial_state if has_initial_state is not None else slot_ids
    inter_arg = inter if inter is not None else state_pool
    inter_strides = inter.stride() if inter is not None else (0, 0, 0, 0, 0)
    grid = (B, hv, triton.cdiv(dv, BV))
    _gdn_recurrent_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        o,
        cu_seqlens,
        slot_ids,
        init,
        state_pool,
        inter_arg,
        *token_strides(q, k, v, g, beta, o),
        *state_pool.stride(),
        *inter_strides,
        float(scale),
        GROUP=hv // hk,
        DK=dk,
        DV=dv,
        BK=BK,
        BV=BV,
        HAS_INIT=has_initial_state is not None,
        HAS_INTER=inter is not None,
    )
    return o
