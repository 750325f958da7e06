"""The sampler's device ops fused for CUDA, one launch each where PyTorch takes 15 to 40: the draw
over sorted candidates (temperature, top-k, top-p, min-p, each candidate's SplitMix64
exponential keyed by (seed, position, token id), the race's pick and its store into the step's
ids, and the head check of top-p / min-p rows), the penalties of the token-count table, and the
table's update by the sampled ids. Their PyTorch references are engine/sampling/filters.py
(candidate_probs, head_suffices, race), engine/sampling/rng.py (token_exponentials) and
engine/sampling/penalties.py (TokenCounts.apply, TokenCounts.record);
tests/kernels/test_sampling_triton.py compares them."""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger("pdserve.kernels")
GAMMA = tl.constexpr(0x9E3779B97F4A7C15)
MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
MIX2 = tl.constexpr(0x94D049BB133111EB)


@triton.jit
def _mix(z):
    """SplitMix64's output function of the uint64 state z."""
    z = (z ^ (z >> 30)) * MIX1
    z = (z ^ (z >> 27)) * MIX2
    return z ^ (z >> 31)


@triton.jit
def _exponentials(seed, ctr, ids):
    """engine/sampling/rng.py's token_exponentials for one row: seed, ctr int64, ids int64 [C]."""
    row = _mix(seed.to(tl.uint64, bitcast=True) + (ctr + 1).to(tl.uint64, bitcast=True) * GAMMA)
    z = _mix(row + (ids + 1).to(tl.uint64, bitcast=True) * GAMMA)
    return -tl.log(((z >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0))


@triton.jit
def _draw_kernel(
    vals_ptr,  # [M, C] float32, sorted descending
    ids_ptr,  # [M, C] int64
    stride_row,
    C,
    temp_ptr,
    topk_ptr,  # int64 [M], 0: all C
    topp_ptr,
    minp_ptr,
    seed_ptr,  # int64 [M]
    ctr_ptr,  # int64 [M]
    seeded_ptr,  # int64 [M], 0: take rand_ptr's seed
    rand_ptr,  # int64 [M]: seeds from the sampler's generator
    total_ptr,  # float32 [M] (HAS_TOTAL)
    q_ptr,  # int64 [M]: where in tokens
    tokens_ptr,  # int64 [N]
    held_ptr,  # int8 [M] (HAS_TOTAL)
    HAS_TOTAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(0)
    r = tl.arange(0, BLOCK)
    valid = r < C
    v = tl.load(vals_ptr + m * stride_row + r, mask=valid, other=float("-inf"))
    t = tl.load(temp_ptr + m)
    k = tl.load(topk_ptr + m)
    top_p = tl.load(topp_ptr + m)
    min_p = tl.load(minp_ptr + m)
    cut = tl.where(k > 0, k, C)
    v = tl.where(r < cut, v, float("-inf"))
    z = v / t
    top = tl.max(z, axis=0)
    # min-p before top-k and top-p (vLLM's order): z >= top + log(min_p), every token at min_p 0
    floor = tl.where(min_p > 0, top + tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))
    kept = (z >= floor) & valid
    if HAS_TOTAL:  # total: the logsumexp of the whole row's min-p tokens
        p = tl.exp(z - tl.load(total_ptr + m))
        p = tl.where(valid, p, 0.0)
        z_last = tl.max(tl.where(r == C - 1, z, float("-inf")), axis=0)
        by_p = (top_p < 1.0).to(tl.int32) * (tl.sum(p, axis=0) >= top_p).to(tl.int32)
        by_min = (min_p > 0).to(tl.int32) * (z_last < floor).to(tl.int32)
        tl.store(held_ptr + m, tl.maximum(by_p, by_min).to(tl.int8))
        p = tl.where(kept, p, 0.0)
    else:
        e = tl.exp(z - top)
        e = tl.where(kept & (r < cut), e, 0.0)
        p = e / tl.sum(e, axis=0)
    before = tl.cumsum(p, axis=0) - p
    keep = (before < tl.where(top_p >= 1.0, float("inf"), top_p)) & kept
    p = tl.where(keep, p, 0.0)
    seeded = tl.load(seeded_ptr + m)
    seed = tl.where(seeded != 0, tl.load(seed_ptr + m), tl.load(rand_ptr + m))
    ids = tl.load(ids_ptr + m * stride_row + r, mask=valid, other=0)
    score = tl.where(p > 0, p / _exponentials(seed, tl.load(ctr_ptr + m), ids), -1.0)
    best = tl.max(score, axis=0)
    idx = tl.min(tl.where(score == best, r, BLOCK), axis=0)  # the first largest, as argmax
    pick = tl.sum(tl.where(r == idx, ids, 0), axis=0)
    tl.store(tokens_ptr + tl.load(q_ptr + m), pick)


def draw_triton(
    vals: torch.Tensor,
    ids: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    seeded: torch.Tensor,
    rand: torch.Tensor,
    q: torch.Tensor,
    tokens: torch.Tensor,
    log_total: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """vals, ids [M, C] (C <= 1024) the sorted candidates of M rows; per row temperature, top_p,
    min_p float32 [M], top_k (0: all), seeds, counters, seeded (0: the row's seed is rand's),
    rand int64 [M], q int64 [M] -> tokens[q] = the ids the race over (seed, counter)'s
    exponentials draws.
    log_total [M]: the candidates are a row's head (engine/sampling/draw.py); then returns int8
    [M], whether the head held every token the filters keep."""
    M, C = vals.shape
    if ids.shape != (M, C) or vals.stride() != ids.stride() or vals.stride(1) != 1 or C > 1024:
        raise ValueError(f"vals, ids must be [M, C <= 1024] row-major alike (got {vals.shape}, {ids.shape})")
    for name, t in (("temperature", temperature), ("top_k", top_k), ("q", q), ("rand", rand), ("seeds", seeds)):
        if t.shape != (M,):
            raise ValueError(f"{name} must be [M={M}] (got {tuple(t.shape)})")
    if rand.dtype != torch.int64:
        raise ValueError(f"rand holds int64 seeds (got {rand.dtype})")
    held = torch.empty(M, dtype=torch.int8, device=vals.device) if log_total is not None else None
    if M:
        total = log_total if log_total is not None else temperature  # not read without HAS_TOTAL
        row = (temperature, top_k, top_p, min_p, seeds, counters, seeded, rand, total, q)
        block = max(16, triton.next_power_of_2(C))
        out = held if held is not None else q
        _draw_kernel[(M,)](
            vals, ids, vals.stride(0), C, *row, tokens, out, HAS_TOTAL=log_total is not None, BLOCK=block
        )
    return held


@triton.jit
def _penalties_kernel(
    x_ptr,
    stride_x,
    pos_ptr,  # int64 [P]: the logits row
    rows_ptr,  # int64 [P]: the table row
    tok_ptr,
    cnt_ptr,
    inp_ptr,
    size_ptr,
    W,
    rep_ptr,
    pf_ptr,  # [P, 2] presence, frequency
    HAS_REP: tl.constexpr,
    HAS_PF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    base = x_ptr + tl.load(pos_ptr + i) * stride_x
    size = tl.load(size_ptr + row)
    for a in range(0, W, BLOCK):
        j = a + tl.arange(0, BLOCK)
        used = j < size
        tok = tl.load(tok_ptr + row * W + j, mask=used, other=0)
        cnt = tl.load(cnt_ptr + row * W + j, mask=used, other=0).to(tl.float32)
        old = tl.load(base + tok, mask=used, other=0.0)
        new = old
        if HAS_REP:
            r = tl.load(rep_ptr + i)
            seen = (tl.load(inp_ptr + row * W + j, mask=used, other=0) != 0) | (cnt > 0)
            new = tl.where(seen, tl.where(old > 0, old / r, old * r), old)
        if HAS_PF:
            pres = tl.load(pf_ptr + 2 * i)
            freq = tl.load(pf_ptr + 2 * i + 1)
            new = new - (pres * (cnt > 0).to(tl.float32) + freq * cnt)
        tl.store(base + tok, new, mask=used)


def penalties_triton(x, pos, rows, tok, cnt, inp, size, rep, pf) -> None:
    """In place on x [N, V]: TokenCounts.apply's penalties (rep [P] or None, pf [P, 2] or None)."""
    P, W = rows.shape[0], tok.shape[1]
    if x.stride(1) != 1 or not (tok.is_contiguous() and cnt.is_contiguous() and inp.is_contiguous()):
        raise ValueError("x rows and the count table must be contiguous")
    if P and W:
        table = (tok, cnt, inp.view(torch.int8), size, W)
        factors = (rep if rep is not None else x, pf if pf is not None else x)  # not read without the flag
        flags = dict(HAS_REP=rep is not None, HAS_PF=pf is not None)
        block = min(1024, max(16, triton.next_power_of_2(W)))
        _penalties_kernel[(P,)](x, x.stride(0), pos, rows, *table, *factors, **flags, BLOCK=block)


@triton.jit
def _record_kernel(rows_ptr, at_ptr, tokens_ptr, tok_ptr, cnt_ptr, size_ptr, W, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    t = tl.load(tokens_ptr + tl.load(at_ptr + i))
    size = tl.load(size_ptr + row)
    found = W
    for a in range(0, W, BLOCK):
        j = a + tl.arange(0, BLOCK)
        hit = (j < size) & (tl.load(tok_ptr + row * W + j, mask=j < W, other=-1) == t)
        found = tl.minimum(found, tl.min(tl.where(hit, j, W), axis=0))
    slot = tl.where(found < W, found, size)
    tl.store(tok_ptr + row * W + slot, t)
    tl.store(cnt_ptr + row * W + slot, tl.load(cnt_ptr + row * W + slot) + 1)
    tl.store(size_ptr + row, tl.where(found < W, size, size + 1))


def record_triton(rows, at, tokens, tok, cnt, size) -> None:
    """TokenCounts.record: table row rows[i] counts tokens[at[i]] (distinct rows)."""
    P, W = rows.shape[0], tok.shape[1]
    if P:
        _record_kernel[(P,)](rows, at, tokens, tok, cnt, size, W, BLOCK=min(1024, max(16, triton.next_power_of_2(W))))


@functools.cache
def available(device: torch.device) -> bool:
    """Whether the three kernels (and the small top-k's) compile and run on `device` (tried once, on tiny inputs): the
    sampler takes its PyTorch path, with a warning, where this Triton cannot build them."""
    try:
        f = torch.ones(2, device=device)
        i = torch.zeros(2, dtype=torch.long, device=device)
        vals = torch.zeros(2, 16, device=device)
        ids = torch.zeros(2, 16, dtype=torch.long, device=device)
        tokens = torch.zeros(2, dtype=torch.long, device=device)
        for total in (None, f):
            draw_triton(vals, ids, f, i, f, f * 0, i, i, i + 1, i, i, tokens, total)
        tok = torch.zeros(2, 16, dtype=torch.long, device=device)
        cnt = torch.zeros(2, 16, dtype=torch.int32, device=device)
        size = torch.zeros(2, dtype=torch.long, device=device)
        x = torch.zeros(2, 16, device=device)
        penalties_triton(x, i, i, tok, cnt, cnt.bool(), size, f, torch.ones(2, 2, device=device))
        record_triton(i[:1], i[:1], tokens, tok, cnt, size)
        from kernels.triton.topk import topk_triton  # the topk group's candidates (engine/sampling/draw.py)

        topk_triton(x, 2, block=16)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return True
    except Exception as e:  # noqa: BLE001 (any build or launch failure: keep the PyTorch path)
        log.warning(
            "the sampler's Triton kernels are unavailable on %s (%s: %s); sampling in PyTorch ops",
            device,
            type(e).__name__,
            e,
        )
        return False
