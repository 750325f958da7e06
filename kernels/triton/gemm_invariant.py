"""The batch-invariant GEMM, Triton: y [M, N] = x [M, K] @ w [N, K]^T with float32 accumulation at
ONE tile configuration, whatever M. Each program owns a [BLOCK_M, BLOCK_N] tile and walks K from 0
in BLOCK_K steps (no split-K), so an output row is the same sum in the same order at any M and
beside any other rows: its bits do not depend on the step it is in (docs/engine.md,
"Batch-invariant mode"). The contract and its PyTorch reference: kernels/gemm.py.
Under the interpreter, whose dot is numpy's matmul (OpenBLAS computes a matrix's last rows with
other instructions than its first: a float32 row's bits change with its place in the tile), the
tile's product is summed elementwise instead; on a GPU every row of an MMA is computed alike."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._common import (
    TL_DTYPES,
    check_last_contiguous,
    check_out,
    check_same_device,
    dot,
    dot_in_f32,
    interpreted,
    round_to,
)

__all__ = ["gemm_invariant_triton", "BLOCK_M", "BLOCK_N", "BLOCK_K", "NUM_WARPS", "NUM_STAGES"]

# The one configuration (never chosen by shape): a tile of rows is padded to BLOCK_M, so a
# decode step's one row runs the same instructions as a prefill's 64.
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3


# M is not specialized: Triton would compile another kernel for M == 1 or M % 16 == 0.
@triton.jit(do_not_specialize=["M"])
def _gemm_invariant_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    s_xm,
    s_wn,
    s_ym,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    YDT: tl.constexpr,
    DOT_F32: tl.constexpr,
    ROW_SUMS: tl.constexpr,
):
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rn = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    mm = rm < M
    mn = rn < N
    rk = tl.arange(0, BK)
    x_rows = x_ptr + rm[:, None] * s_xm
    w_rows = w_ptr + rn[:, None] * s_wn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):  # in order from 0: the one summation order
        kk = k0 + rk
        mk = kk < K
        xt = tl.load(x_rows + kk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        wt = tl.load(w_rows + kk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        if ROW_SUMS:  # the interpreter: products then sums over k, the same for every row
            acc += tl.sum(xt.to(tl.float32)[:, :, None] * tl.trans(wt).to(tl.float32)[None, :, :], 1)
        else:
            acc += dot(xt, tl.trans(wt), DOT_F32)
    y = round_to(acc, YDT)  # round to nearest even (a cast truncates under the interpreter)
    tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def gemm_invariant_triton(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ w [N, K]^T in their dtype (float32, bfloat16 or float16, the same for
    both), float32 sums at the fixed tiles above; into `out` [M, N] when given."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [M, K] and w [N, K] (got x={tuple(x.shape)}, w={tuple(w.shape)})")
    if x.dtype != w.dtype or x.dtype not in TL_DTYPES:
        raise ValueError(f"x and w must share a dtype of float32, bfloat16, float16 (got {x.dtype}, {w.dtype})")
    check_last_contiguous(x=x, w=w)
    check_same_device(x=x, w=w)
    M, K = x.shape
    N = w.shape[0]
    check_out(out, (M, N), x.dtype, x.device)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _gemm_invariant_kernel[grid](
        x,
        w,
        y,
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
        YDT=TL_DTYPES[x.dtype],
        DOT_F32=dot_in_f32(x.dtype),
        ROW_SUMS=interpreted(),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return y
