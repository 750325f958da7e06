"""Block-scaled FP8 GEMM, Triton: y = x W^T with W stored as float8_e4m3fn blocks, each weight tile
dequantized as it is loaded, activations unquantized, so it computes what the CPU load path
computes (docs/kernels.md, "Module notes")."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_fp8_block
from kernels.triton._common import (
    TL_DTYPES,
    check_last_contiguous,
    check_out,
    check_same_device,
    dot,
    dot_in_f32,
    round_to,
)

__all__ = ["fp8_block_linear_triton", "weight_tile", "k_tile"]


@triton.jit
def weight_tile(w_rows, s_rows, kk, k0, n_in, k_in, QK, SCALED: tl.constexpr, ALIGNED: tl.constexpr, XDT: tl.constexpr):
    """A [BN, BK] tile of an [N, K] weight in XDT: rows `w_rows` [BN, 1] (pointers), columns kk.
    SCALED: the weight is float8_e4m3fn and s_rows [BN, 1] point at each row's scales (one per QK
    columns); the tile is dequantized and rounded to XDT. ALIGNED: the tile lies in one scale block."""
    w = tl.load(w_rows + kk[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0)
    if SCALED:
        if ALIGNED:
            s = tl.load(s_rows + k0 // QK, mask=n_in[:, None], other=0.0)
        else:
            s = tl.load(s_rows + (kk // QK)[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0)
        w = round_to(w.to(tl.float32) * s, XDT).to(XDT)
    return w


@triton.jit
def _fp8_block_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    T,
    N,
    K,
    s_x,
    s_w,
    s_s,
    s_y,
    QN,
    QK,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ALIGNED: tl.constexpr,
    XDT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_in, n_in = rm < T, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * s_x
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * s_w
    s_rows = s_ptr + (rn // QN)[:, None] * s_s  # each output column's row of scales
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        k_in = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0)
        w = weight_tile(w_rows, s_rows, kk, k0, n_in, k_in, QK, True, ALIGNED, XDT)
        acc += dot(x, tl.trans(w), DOT_F32)
    y = y_ptr + rm.to(tl.int64)[:, None] * s_y + rn[None, :]
    tl.store(y, round_to(acc, XDT).to(y_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


def k_tile(bk: int) -> tuple[int, bool]:
    """(K tile, whether it stays inside one scale block of bk columns)."""
    tile = bk & -bk  # largest power of two dividing bk
    if tile >= 16:
        return min(tile, 128), True
    return 32, False


def fp8_block_linear_triton(
    x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor, block_size, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton fp8_block_linear (see kernels.fp8 and the module). Returns y [T, N] in x's dtype."""
    bn, bk = check_fp8_block(w_fp8, scale_inv, block_size)
    if x.dim() != 2 or w_fp8.dim() != 2 or x.shape[1] != w_fp8.shape[1]:
        raise ValueError(f"x must be [T, K] and w_fp8 [N, K] (got x={tuple(x.shape)}, w_fp8={tuple(w_fp8.shape)})")
    if x.dtype not in TL_DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16 (got x={tuple(x.shape)}:{x.dtype})")
    check_same_device(x=x, w_fp8=w_fp8, scale_inv=scale_inv)
    check_last_contiguous(x=x, w_fp8=w_fp8, scale_inv=scale_inv)
    T, K = x.shape
    N = w_fp8.shape[0]
    check_out(out, (T, N), x.dtype, x.device)
    y = torch.empty((T, N), dtype=x.dtype, device=x.device) if out is None else out
    if y.numel():
        BM = min(64, max(16, triton.next_power_of_2(T)))
        BN = 64
        BK, aligned = k_tile(bk)
        grid = (triton.cdiv(T, BM), triton.cdiv(N, BN))
        _fp8_block_linear_kernel[grid](
            x,
            w_fp8,
            scale_inv,
            y,
            T,
            N,
            K,
            x.stride(0),
            w_fp8.stride(0),
            scale_inv.stride(0),
            y.stride(0),
            bn,
            bk,
            BM=BM,
            BN=BN,
            BK=BK,
            ALIGNED=aligned,
            XDT=TL_DTYPES[x.dtype],
            DOT_F32=dot_in_f32(x.dtype),
        )
    return y
