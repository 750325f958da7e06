"""The sampler's top-k for small k on CUDA: the k largest logits of each row, sorted, in two
launches and no host read, where torch.topk's radix select takes about 17 launches and 190 us
at 64 x 151,936 on an H100 (docs/benchmarks.md). Stage 1 splits each row into blocks of BLOCK
columns and takes each block's k largest by k rounds of (max, lowest column holding it); stage 2
does the same over a row's block candidates. Ties go to the lower id, NaN counts as -inf, and a
row with fewer than k finite values fills up with its lowest -inf ids. Reference:
engine/sampling/filters.py `topk_reference`; tests/kernels/test_topk_triton.py compares them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TOPK_SMALL = 64  # the largest k these kernels take (the sampler's torch.topk above it)
BLOCK = 4096  # columns of a row a stage-1 program reads
_NO_ID = tl.constexpr(2**31 - 1)  # above every column id


@triton.jit
def _rounds(x, ids, alive, out_v_ptr, out_i_ptr, K):
    """K rounds over one program's values x and ids: each stores the largest alive value and the
    lowest id holding it, then retires that id."""
    for i in range(K):
        m = tl.max(tl.where(alive, x, float("-inf")), axis=0)
        pick = tl.min(tl.where(alive & (x == m), ids, _NO_ID), axis=0)
        tl.store(out_v_ptr + i, m)
        tl.store(out_i_ptr + i, pick)
        alive = alive & (ids != pick)


@triton.jit
def _stage1(x_ptr, stride_x, V, cand_v_ptr, cand_i_ptr, K, KPAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    cols = split * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=inside, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))  # NaN -> -inf
    base = (row.to(tl.int64) * tl.num_programs(1) + split) * KPAD
    _rounds(x, cols, inside, cand_v_ptr + base, cand_i_ptr + base, K)


@triton.jit
def _stage2(cand_v_ptr, cand_i_ptr, SPLITS, out_v_ptr, out_i_ptr, K, KPAD: tl.constexpr, CBLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, CBLOCK)
    valid = (j < SPLITS * KPAD) & ((j % KPAD) < K)
    base = row.to(tl.int64) * SPLITS * KPAD
    x = tl.load(cand_v_ptr + base + j, mask=valid, other=float("-inf"))
    ids = tl.load(cand_i_ptr + base + j, mask=valid, other=_NO_ID)
    out = row.to(tl.int64) * K
    _rounds(x, ids, valid, out_v_ptr + out, out_i_ptr + out, K)


def topk_triton(x: torch.Tensor, k: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, V] float (float32, bfloat16 or float16; rows contiguous), 1 <= k <= min(TOPK_SMALL, V)
    -> (values float32 [N, k] descending, ids int64 [N, k]). `block`: a power of two >= k."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, V] with contiguous rows (got shape {tuple(x.shape)}, strides {x.stride()})")
    n, v = x.shape
    if not 1 <= k <= min(TOPK_SMALL, v):
        raise ValueError(f"k must be in 1..{min(TOPK_SMALL, v)} for a vocabulary of {v} (got {k})")
    if block < k or block & (block - 1):
        raise ValueError(f"block must be a power of two >= k (got {block})")
    kpad = triton.next_power_of_2(k)
    splits = triton.cdiv(v, block)
    vals = torch.empty(n, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(n, k, dtype=torch.int64, device=x.device)
    if n:
        cand_v = torch.empty(n, splits, kpad, dtype=torch.float32, device=x.device)
        cand_i = torch.empty(n, splits, kpad, dtype=torch.int32, device=x.device)
        warps = 8 if block >= 2048 else 4
        _stage1[(n, splits)](x, x.stride(0), v, cand_v, cand_i, k, KPAD=kpad, BLOCK=block, num_warps=warps)
        cblock = triton.next_power_of_2(splits * kpad)
        _stage2[(n,)](cand_v, cand_i, splits, vals, ids, k, KPAD=kpad, CBLOCK=cblock, num_warps=8)
    return vals, ids
