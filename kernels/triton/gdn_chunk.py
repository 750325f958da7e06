"""Chunked gated delta rule over packed variable-length sequences (prefill), Triton, with
kernels.gdn.gdn_chunk_prefill's contract: a per-chunk launch over every chunk at once (triangular
inverse, U, W), then a sequential state pass per (sequence, head, dv block); products of computed
values at float32 accuracy (docs/kernels.md, "Module notes")."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_gdn_inputs, check_points_dtype
from kernels.points import StatePoints, check_points
from kernels.triton._common import (
    check_flags,
    check_index,
    check_last_contiguous,
    check_out,
    check_same_device,
    dot,
    dot_in_f32,
    f32_precision,
    pow2,
    row_lengths,
    token_strides,
)

__all__ = ["gdn_chunk_prefill_triton"]

_SUB = 16  # diagonal block of the triangular inverse


@triton.jit
def _gdn_chunk_prep_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    cu_ptr,
    w_ptr,
    u_ptr,
    B,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_gt,
    s_gh,
    s_bt,
    s_bh,
    s_wt,
    s_wh,
    s_ut,
    s_uh,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BVA: tl.constexpr,
    C: tl.constexpr,
    SUB: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
):
    cid = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    # Which sequence and chunk this program owns: chunks are numbered sequence by sequence.
    c0 = tl.zeros((), dtype=tl.int64)
    end = tl.zeros((), dtype=tl.int64)
    found = cid < 0
    seen = tl.zeros((), dtype=tl.int64)
    for b in range(0, B):
        s = tl.load(cu_ptr + b).to(tl.int64)
        e = tl.load(cu_ptr + b + 1).to(tl.int64)
        n = (e - s + C - 1) // C
        hit = (cid >= seen) & (cid < seen + n)
        c0 = tl.where(hit, s + (cid - seen) * C, c0)
        end = tl.where(hit, e, end)
        found = found | hit
        seen += n
    if found:
        rc = tl.arange(0, C)
        rk = tl.arange(0, BK)
        rv = tl.arange(0, BVA)
        mk = rk < DK
        mv = rv < DV
        rows = c0 + rc
        mr = rows < end
        K = tl.load(k_ptr + rows[:, None] * s_kt + hk * s_kh + rk[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
        V = tl.load(v_ptr + rows[:, None] * s_vt + h * s_vh + rv[None, :], mask=mr[:, None] & mv[None, :], other=0.0)
        gv = tl.load(g_ptr + rows * s_gt + h * s_gh, mask=mr, other=0.0).to(tl.float32)
        be = tl.load(beta_ptr + rows * s_bt + h * s_bh, mask=mr, other=0.0).to(tl.float32)

        causal = rc[:, None] >= rc[None, :]
        strict = rc[:, None] > rc[None, :]
        eye = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
        sub_r = rc // SUB
        same_sub = sub_r[:, None] == sub_r[None, :]
        in_sub = rc % SUB

        gam = tl.cumsum(gv, 0)
        Gam = tl.exp(tl.where(causal, gam[:, None] - gam[None, :], float("-inf")))
        A = dot(K, tl.trans(K), DOT_F32) * be[:, None]
        A = tl.where(strict, A * Gam, 0.0)

        # Diagonal blocks, row i of every block at once: X[i] = e_i - sum_j A[i, j] X[j] (j < i,
        # same block). `a_i` gathers row i of each block into its block's columns.
        A_diag = tl.where(same_sub, A, 0.0)
        X = eye
        for i in range(1, SUB):
            a_i = tl.sum(tl.where(in_sub[:, None] == i, A_diag, 0.0), 0)  # [C]: A[blk(j)*SUB + i, j]
            t = tl.sum(a_i[:, None] * X, 0)  # [C]: sum_j A[blk(c)*SUB + i, j] X[j, c]
            X = tl.where((in_sub[:, None] == i) & same_sub, eye - t[None, :], X)
        X_diag = X
        for blk in range(1, C // SUB):
            row_in = sub_r[:, None] == blk
            R = tl.dot(tl.where(row_in & (sub_r[None, :] < blk), A, 0.0), X, input_precision=PREC)
            X = tl.where(row_in, X - tl.dot(X_diag, R, input_precision=PREC), X)

        eg = tl.exp(gam)
        U = tl.dot(X, V.to(tl.float32) * be[:, None], input_precision=PREC)
        W = tl.dot(X, K.to(tl.float32) * (be * eg)[:, None], input_precision=PREC)
        tl.store(u_ptr + rows[:, None] * s_ut + h * s_uh + rv[None, :], U, mask=mr[:, None] & mv[None, :])
        tl.store(w_ptr + rows[:, None] * s_wt + h * s_wh + rk[None, :], W, mask=mr[:, None] & mk[None, :])


@triton.jit
def _gdn_chunk_state_kernel(
    q_ptr,
    k_ptr,
    g_ptr,
    w_ptr,
    u_ptr,
    o_ptr,
    cu_ptr,
    slot_ptr,
    init_ptr,
    pool_ptr,
    pt_ptr,
    off_ptr,
    dest_ptr,
    snap_ptr,
    s_qt,
    s_qh,
    s_kt,
    s_kh,
    s_gt,
    s_gh,
    s_wt,
    s_wh,
    s_ut,
    s_uh,
    s_ot,
    s_oh,
    s_ps,
    s_ph,
    s_pk,
    s_pv,
    s_ns,
    s_nh,
    s_nk,
    s_nv,
    scale,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_POINTS: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
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
    rc = tl.arange(0, C)

    s_ptrs = pool_ptr + slot * s_ps + h * s_ph + rk[:, None] * s_pk + rv[None, :] * s_pv
    s_mask = mk[:, None] & mv[None, :]
    S = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)  # float32 or bfloat16 pool
    if HAS_INIT:
        # where(), not a multiply: a never-written slot may hold NaN.
        S = tl.where(tl.load(init_ptr + b) != 0, S, 0.0)

    causal = rc[:, None] >= rc[None, :]
    p0 = 0
    p1 = 0
    if HAS_POINTS:
        p0 = tl.load(pt_ptr + b).to(tl.int64)
        p1 = tl.load(pt_ptr + b + 1).to(tl.int64)

    for c0 in range(start, end, C):
        rows = c0 + rc
        mr = rows < end
        mrk = mr[:, None] & mk[None, :]
        mrv = mr[:, None] & mv[None, :]
        K = tl.load(k_ptr + rows[:, None] * s_kt + hk * s_kh + rk[None, :], mask=mrk, other=0.0)
        Q = tl.load(q_ptr + rows[:, None] * s_qt + hk * s_qh + rk[None, :], mask=mrk, other=0.0)
        W = tl.load(w_ptr + rows[:, None] * s_wt + h * s_wh + rk[None, :], mask=mrk, other=0.0)
        U = tl.load(u_ptr + rows[:, None] * s_ut + h * s_uh + rv[None, :], mask=mrv, other=0.0)
        gv = tl.load(g_ptr + rows * s_gt + h * s_gh, mask=mr, other=0.0).to(tl.float32)
        gam = tl.cumsum(gv, 0)
        eg = tl.exp(gam)

        Vn = U - tl.dot(W, S, input_precision=PREC)
        Gam = tl.exp(tl.where(causal, gam[:, None] - gam[None, :], float("-inf")))
        P = tl.where(causal, dot(Q, tl.trans(K), DOT_F32) * Gam, 0.0) * scale
        Qf = Q.to(tl.float32) * scale
        O = tl.dot(Qf * eg[:, None], S, input_precision=PREC) + tl.dot(P, Vn, input_precision=PREC)
        tl.store(o_ptr + rows[:, None] * s_ot + h * s_oh + rv[None, :], O.to(o_ptr.dtype.element_ty), mask=mrv)

        Kf = K.to(tl.float32)
        if HAS_POINTS:
            for pi in range(p0, p1):
                j = tl.load(off_ptr + pi).to(tl.int64) - 1 - (c0 - start)  # the point's token in this chunk
                if (j >= 0) & (j < C):
                    gj = tl.sum(tl.where(rc == j, gam, 0.0), 0)
                    Kj = tl.where((rc <= j)[:, None], Kf * tl.exp(tl.minimum(gj - gam, 0.0))[:, None], 0.0)
                    Sj = S * tl.exp(gj) + tl.dot(tl.trans(Kj), Vn, input_precision=PREC)
                    d = tl.load(dest_ptr + pi).to(tl.int64)
                    n_ptrs = snap_ptr + d * s_ns + h * s_nh + rk[:, None] * s_nk + rv[None, :] * s_nv
                    tl.store(n_ptrs, Sj.to(snap_ptr.dtype.element_ty), mask=s_mask)

        g_last = tl.sum(gv, 0)  # = gamma at the chunk's last valid row (padding has g = 0)
        Kd = Kf * tl.exp(g_last - gam)[:, None]
        S = S * tl.exp(g_last) + tl.dot(tl.trans(Kd), Vn, input_precision=PREC)

    tl.store(s_ptrs, S.to(pool_ptr.dtype.element_ty), mask=s_mask)


def gdn_chunk_prefill_triton(
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
    chunk_size: int = 64,
    out: torch.Tensor | None = None,
    points: StatePoints | None = None,
    points_pool: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Triton gdn_chunk_prefill (see kernels.gdn). `out` [T, Hv, dv] in v's dtype, if given,
    receives o. chunk_size must be a power of two >= 16; slot_ids must be distinct. Uses float32
    workspaces of T x Hv x (dk + dv) values for the state-independent part of each chunk."""
    check_gdn_inputs(q, k, v, g, beta, cu_seqlens, state_pool, slot_ids, max_len)
    if points is not None:
        check_points(points, cu_seqlens, points_pool, state_pool.shape[1:])
        check_same_device(q=q, ptr=points.ptr, offsets=points.offsets, dest=points.dest, points_pool=points_pool)
        check_points_dtype(points_pool, state_pool)
    check_index(cu_seqlens=cu_seqlens, slot_ids=slot_ids)
    check_last_contiguous(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, state_pool=state_pool, slot_ids=slot_ids)
    B = cu_seqlens.numel() - 1
    check_flags("has_initial_state", has_initial_state, B)
    if chunk_size < _SUB or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= {_SUB} (got {chunk_size})")
    if max_len is None:
        row_lengths(cu_seqlens)  # rows must not run backwards
    T, hv, dv = v.shape
    hk, dk = q.shape[1:]
    check_out(out, (T, hv, dv), v.dtype, v.device)
    o = torch.empty_like(v, memory_format=torch.contiguous_format) if out is None else out
    if T == 0:
        return o
    scale = dk**-0.5 if scale is None else scale
    BK = pow2(dk)
    BV = min(pow2(dv), 32)
    C = chunk_size
    f32 = dot_in_f32(q.dtype)
    prec = f32_precision()
    w = torch.empty(T, hv, dk, dtype=torch.float32, device=v.device)
    u = torch.empty(T, hv, dv, dtype=torch.float32, device=v.device)
    max_chunks = T // C + B  # each sequence adds at most one partial chunk
    _gdn_chunk_prep_kernel[(max_chunks, hv)](
        k,
        v,
        g,
        beta,
        cu_seqlens,
        w,
        u,
        B,
        *token_strides(k, v, g, beta, w, u),
        GROUP=hv // hk,
        DK=dk,
        DV=dv,
        BK=BK,
        BVA=pow2(dv),
        C=C,
        SUB=_SUB,
        DOT_F32=f32,
        PREC=prec,
        num_warps=8,
    )
    init = has_initial_state if has_initial_state is not None else slot_ids  # unread when HAS_INIT is False
    _gdn_chunk_state_kernel[(B, hv, triton.cdiv(dv, BV))](
        q,
        k,
        g,
        w,
        u,
        o,
        cu_seqlens,
        slot_ids,
        init,
        state_pool,
        points.ptr if points is not None else slot_ids,  # unread when HAS_POINTS is False
        points.offsets if points is not None else slot_ids,
        points.dest if points is not None else slot_ids,
        points_pool if points is not None else state_pool,
        *token_strides(q, k, g, w, u, o),
        *state_pool.stride(),
        *(points_pool if points is not None else state_pool).stride(),
        float(scale),
        GROUP=hv // hk,
        DK=dk,
        DV=dv,
        BK=BK,
        BV=BV,
        C=C,
        HAS_INIT=has_initial_state is not None,
        HAS_POINTS=points is not None and points.num_points > 0,
        DOT_F32=f32,
        PREC=prec,
        num_stages=1 if q.dtype == torch.float32 else 2,  # float32 tiles x 3 stages overflow shared memory
    )
    return o
