"""Paged attention and the KV store, Triton, with kernels.attention's contract: one program per
(row, KV head, tile of new tokens) streams the row's pages with an online softmax, reading each
page once per GQA group; one launch serves decode, verification and chunked prefill
(docs/kernels.md, "Module notes")."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_paged_inputs
from kernels.triton._common import (
    check_index,
    check_last_contiguous,
    check_out,
    check_same_device,
    dot,
    dot_in_f32,
    pow2,
    row_lengths,
)

__all__ = ["store_kv_triton", "paged_attention_triton"]


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    pool_ptr,
    slot_ptr,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_pb,
    s_pkv,
    s_ph,
    s_pt,
    KVH: tl.constexpr,
    HD: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    rh = tl.arange(0, BH).to(tl.int64)
    rd = tl.arange(0, BD)
    m = (rh < KVH)[:, None] & (rd < HD)[None, :]
    dst = pool_ptr + blk * s_pb + rh[:, None] * s_ph + off * s_pt + rd[None, :]
    kt = tl.load(k_ptr + t * s_kt + rh[:, None] * s_kh + rd[None, :], mask=m)
    vt = tl.load(v_ptr + t * s_vt + rh[:, None] * s_vh + rd[None, :], mask=m)
    tl.store(dst, kt.to(pool_ptr.dtype.element_ty), mask=m)
    tl.store(dst + s_pkv, vt.to(pool_ptr.dtype.element_ty), mask=m)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, kv_pool: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton store_kv (see kernels.attention): k, v [T, KVH, hd] at flat token slots."""
    if (
        k.shape != v.shape
        or k.dim() != 3
        or kv_pool.dim() != 5
        or tuple(k.shape[1:]) != (kv_pool.shape[2], kv_pool.shape[4])
    ):
        raise ValueError(
            f"k, v must be [T, KVH, hd] matching kv_pool [num_blocks, 2, KVH, block_size, hd] "
            f"(got k={tuple(k.shape)}, v={tuple(v.shape)}, kv_pool={tuple(kv_pool.shape)})"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}] (got {tuple(slot_mapping.shape)})")
    check_index(slot_mapping=slot_mapping)
    check_last_contiguous(k=k, v=v, kv_pool=kv_pool)
    check_same_device(k=k, v=v, kv_pool=kv_pool, slot_mapping=slot_mapping)
    T, kvh, hd = k.shape
    if T == 0:
        return
    _store_kv_kernel[(T,)](
        k,
        v,
        kv_pool,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_pool.stride(0),
        kv_pool.stride(1),
        kv_pool.stride(2),
        kv_pool.stride(3),
        KVH=kvh,
        HD=hd,
        BH=triton.next_power_of_2(kvh),
        BD=triton.next_power_of_2(hd),
        BLOCK_SIZE=kv_pool.shape[3],
    )


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    o_ptr,
    pool_ptr,
    cu_ptr,
    seq_lens_ptr,
    bt_ptr,
    s_qt,
    s_qh,
    s_ot,
    s_oh,
    s_pb,
    s_pkv,
    s_ph,
    s_pt,
    s_btb,
    scale,
    GROUP: tl.constexpr,
    GP: tl.constexpr,
    TOK: tl.constexpr,
    HD: tl.constexpr,
    BD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BN: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    q_start = tl.load(cu_ptr + b).to(tl.int64)
    q_len = tl.load(cu_ptr + b + 1).to(tl.int64) - q_start
    ctx = tl.load(seq_lens_ptr + b).to(tl.int64)

    # Tile rows: TOK new tokens x GP query heads of this KV head's group (GP = GROUP rounded up
    # to a power of two; the extra heads are padding), so each K/V page is read once per group.
    rm = tl.arange(0, TOK * GP)
    tok = tile * TOK + rm // GP
    head = kvh * GROUP + rm % GP
    mm = (tok < q_len) & (rm % GP < GROUP)
    q_pos = ctx - q_len + tok  # absolute positions of the rows' tokens
    rd = tl.arange(0, BD)
    md = rd < HD
    q_rows = (q_start + tok)[:, None] * s_qt + head[:, None] * s_qh + rd[None, :]
    q = tl.load(q_ptr + q_rows, mask=mm[:, None] & md[None, :], other=0.0)

    m_i = tl.full((TOK * GP,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((TOK * GP,), dtype=tl.float32)
    acc = tl.zeros((TOK * GP, BD), dtype=tl.float32)
    rn = tl.arange(0, BN)
    mn = rn < BLOCK_SIZE
    # One past the last position this tile attends to; a tile past the row's end reads nothing.
    kv_end = ctx - q_len + tl.minimum((tile + 1) * TOK, q_len)
    kv_end = tl.where(tile * TOK < q_len, kv_end, 0)
    for j in range(0, tl.cdiv(kv_end, BLOCK_SIZE)):
        page = tl.load(bt_ptr + b.to(tl.int64) * s_btb + j).to(tl.int64)
        base = pool_ptr + page * s_pb + kvh * s_ph + rn[:, None] * s_pt + rd[None, :]
        k_pos = j * BLOCK_SIZE + rn
        # Positions past seq_len are never read: a page's unwritten tail may hold anything.
        # Pages are cast to q's dtype as the reference does; scores accumulate in float32.
        key_ok = mn & (k_pos < ctx)
        kv_mask = key_ok[:, None] & md[None, :]
        kt = tl.load(base, mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
        vt = tl.load(base + s_pkv, mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
        s = dot(q, tl.trans(kt), DOT_F32) * scale
        s = tl.where((k_pos[None, :] <= q_pos[:, None]) & key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = dot(p, vt, DOT_F32)
        else:  # probabilities rounded to the pages' 16-bit dtype for the tensor-core product
            pv = dot(p.to(vt.dtype), vt, DOT_F32)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i = 0 only on padding rows, never stored
    o_rows = (q_start + tok)[:, None] * s_ot + head[:, None] * s_oh + rd[None, :]
    tl.store(o_ptr + o_rows, o.to(o_ptr.dtype.element_ty), mask=mm[:, None] & md[None, :])


def paged_attention_triton(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Triton paged_attention (see kernels.attention). Returns [T, H, hd] in q's dtype (into
    `out` when given). Every row must have seq_lens[b] >= its number of new tokens. max_len: the
    most new tokens of a row, when the caller knows it (kernels/checks.py: no read back)."""
    check_paged_inputs(q, kv_pool, cu_seqlens_q, seq_lens, block_tables, max_len)
    check_index(cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)
    if block_tables.dtype not in (torch.int32, torch.int64) or block_tables.stride(-1) != 1:
        raise ValueError(
            f"block_tables must be int32/int64 with unit stride on its last axis "
            f"(got {tuple(block_tables.shape)}:{block_tables.dtype} strides {block_tables.stride()})"
        )
    check_last_contiguous(q=q, kv_pool=kv_pool)
    check_same_device(q=q, kv_pool=kv_pool, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, block_tables=block_tables)
    B = cu_seqlens_q.numel() - 1
    max_q = max(row_lengths(cu_seqlens_q)) if max_len is None else max_len
    T, H, hd = q.shape
    check_out(out, (T, H, hd), q.dtype, q.device)
    o = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if T == 0:
        return o
    kvh, bs = kv_pool.shape[2], kv_pool.shape[3]
    group = H // kvh
    gp = triton.next_power_of_2(group)
    # Rows per tile: at least 16 (tl.dot); prefill tiles 64 (32 for head dims over 128, which
    # keeps the float32 accumulator in registers); a decode row's tile holds its one token.
    rows = 16 if max_q == 1 else (64 if hd <= 128 else 32)
    tok = max(1, rows // gp)
    grid = (B, kvh, triton.cdiv(max_q, tok))
    _paged_attention_kernel[grid](
        q,
        o,
        kv_pool,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        q.stride(0),
        q.stride(1),
        o.stride(0),
        o.stride(1),
        kv_pool.stride(0),
        kv_pool.stride(1),
        kv_pool.stride(2),
        kv_pool.stride(3),
        block_tables.stride(0),
        float(scale),
        GROUP=group,
        GP=gp,
        TOK=tok,
        HD=hd,
        BD=pow2(hd),
        BLOCK_SIZE=bs,
        BN=pow2(bs),
        DOT_F32=dot_in_f32(q.dtype),
    )
    return o
