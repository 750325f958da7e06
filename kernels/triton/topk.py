"""The sampler's top-k for small k on CUDA: the k largest logits of each row, sorted, in four
launches and no host read, where torch.topk's radix select takes about 17 launches and 190 us
at 64 x 151,936 on an H100 (docs/benchmarks.md). Each (value, id) is one int64 key that orders
as the top-k does, so a round is one max: stage 1 splits each row into blocks of BLOCK columns
and takes each block's k largest keys by rounds, down to the row's threshold (the k-th largest
block maximum, two launches before it), so most blocks take one round; stage 2 does the same
over a row's block candidates and unpacks the keys. Ties go to the lower id, NaN counts as -inf, and a
row with fewer than k finite values fills up with its lowest -inf ids. Reference:
engine/sampling/filters.py `topk_reference`; tests/kernels/test_topk_triton.py compares them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TOPK_SMALL = 64  # the largest k these kernels take (the sampler's torch.topk above it)
BLOCK = 1024  # columns of a row a stage-1 program reads (H100: 69 us at 1024 against 137 at 2048, docs/gpu.md)
_DEAD = tl.constexpr(-(2**63))  # below every key
_LOW = tl.constexpr(0x7FFFFFFF)  # ids < 2**31


@triton.jit
def _keys(x, ids):
    """One int64 per (value, id) whose order is the top-k's: the value's bits made signed-int
    ordered (NaN read as -inf, -0.0 as +0.0) above, 2**31 - 1 - id below (ties to the lower id)."""
    x = tl.where(x == x, x, float("-inf"))
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (ids.to(tl.int64) * -1 + _LOW)


@triton.jit
def _block_keys(x_ptr, stride_x, V, BLOCK: tl.constexpr):
    """The program's block (program ids: row, block) of its row as keys, _DEAD past the row."""
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    x = tl.load(x_ptr + tl.program_id(0).to(tl.int64) * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    return tl.where(inside, _keys(x, cols), _DEAD)


@triton.jit
def _block_max(x_ptr, stride_x, V, bmax_ptr, BLOCK: tl.constexpr):
    """Pruning, first launch: each block's largest key."""
    keys = _block_keys(x_ptr, stride_x, V, BLOCK)
    out = bmax_ptr + tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    tl.store(out, tl.max(keys, axis=0))


@triton.jit
def _threshold(bmax_ptr, SPLITS, thr_ptr, K, SB: tl.constexpr):
    """Pruning, second launch: the K-th largest of a row's block maxima. K blocks hold a key at
    least this large, so the row's K largest keys are all at least this large (_DEAD with fewer
    than K blocks: nothing pruned)."""
    row = tl.program_id(0)
    j = tl.arange(0, SB)
    keys = tl.load(bmax_ptr + row.to(tl.int64) * SPLITS + j, mask=j < SPLITS, other=_DEAD)
    m = tl.max(keys, axis=0)
    for _ in range(K - 1):
        keys = tl.where(keys == m, _DEAD, keys)
        m = tl.max(keys, axis=0)
    tl.store(thr_ptr + row, m)


@triton.jit
def _stage1(x_ptr, stride_x, V, thr_ptr, cand_ptr, K, KPAD: tl.constexpr, BLOCK: tl.constexpr):
    """Each block's K largest keys, largest first, down to its row's threshold (_DEAD: none): a
    block stops at its first key below it (with pruning most blocks hold none, so most programs
    take one max); its other candidate places get _DEAD."""
    row = tl.program_id(0)
    keys = _block_keys(x_ptr, stride_x, V, BLOCK)
    t = tl.load(thr_ptr + row)
    out = cand_ptr + (row.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * KPAD
    m = tl.max(keys, axis=0)
    i = 0
    while (i < K) & (m >= t):
        tl.store(out + i, m)
        keys = tl.where(keys == m, _DEAD, keys)
        m = tl.max(keys, axis=0)
        i += 1
    places = tl.arange(0, KPAD)
    tl.store(out + places, tl.zeros([KPAD], dtype=tl.int64) + _DEAD, mask=(places >= i) & (places < K))


@triton.jit
def _stage2(cand_ptr, SPLITS, out_v_ptr, out_i_ptr, K, KPAD: tl.constexpr, CBLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, CBLOCK)
    valid = (j < SPLITS * KPAD) & ((j % KPAD) < K)
    keys = tl.load(cand_ptr + row.to(tl.int64) * SPLITS * KPAD + j, mask=valid, other=_DEAD)
    for i in range(K):
        m = tl.max(keys, axis=0)
        ordered = (m >> 32).to(tl.int32)
        bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
        tl.store(out_v_ptr + row.to(tl.int64) * K + i, bits.to(tl.float32, bitcast=True))
        tl.store(out_i_ptr + row.to(tl.int64) * K + i, (m & _LOW) * -1 + _LOW)
        keys = tl.where(keys == m, _DEAD, keys)


def topk_triton(
    x: torch.Tensor, k: int, block: int = BLOCK, warps: int | None = None, prune: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, V] float (float32, bfloat16 or float16; rows contiguous), 1 <= k <= min(TOPK_SMALL, V)
    -> (values float32 [N, k] descending, ids int64 [N, k]). `block`: a power of two >= k;
    `warps`: a stage-1 program's (default 8 for blocks of 4096 and more, else 2). prune: two
    more launches find each row's threshold first (its k-th largest block maximum), so stage 1
    takes a block's keys only down to it: k rounds over a few blocks instead of over every one."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, V] with contiguous rows (got shape {tuple(x.shape)}, strides {x.stride()})")
    n, v = x.shape
    if not 1 <= k <= min(TOPK_SMALL, v):
        raise ValueError(f"k must be in 1..{min(TOPK_SMALL, v)} for a vocabulary of {v} (got {k})")
    if block < k or block & (block - 1):
        raise ValueError(f"block must be a power of two >= k (got {block})")
    if v >= 2**31:
        raise ValueError(f"ids must fit 31 bits (a vocabulary of {v})")
    kpad = triton.next_power_of_2(k)
    splits = triton.cdiv(v, block)
    vals = torch.empty(n, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(n, k, dtype=torch.int64, device=x.device)
    if n:
        cand = torch.empty(n, splits, kpad, dtype=torch.int64, device=x.device)
        warps = warps or (8 if block >= 4096 else 2)
        if prune and splits > k:
            bmax = torch.empty(n, splits, dtype=torch.int64, device=x.device)
            thr = torch.empty(n, dtype=torch.int64, device=x.device)
            _block_max[(n, splits)](x, x.stride(0), v, bmax, BLOCK=block, num_warps=warps)
            _threshold[(n,)](bmax, splits, thr, k, SB=triton.next_power_of_2(splits), num_warps=4)
        else:  # no threshold: every block gives its k largest
            thr = torch.full((n,), -(2**63), dtype=torch.int64, device=x.device)
        _stage1[(n, splits)](x, x.stride(0), v, thr, cand, k, KPAD=kpad, BLOCK=block, num_warps=warps)
        cblock = triton.next_power_of_2(splits * kpad)
        _stage2[(n,)](cand, splits, vals, ids, k, KPAD=kpad, CBLOCK=cblock, num_warps=8)
    return vals, ids
