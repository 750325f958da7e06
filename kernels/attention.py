"""Paged attention, PyTorch path: the KV store and causal attention over pages,
`kv_pool [num_blocks, 2, KVH, block_size, hd]` with any strides (the engine's head-major pools
seen through a view). One call serves decode, speculative verification and chunked prefill
(shapes: docs/kernels.md, "Module notes")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import check_paged_inputs
from kernels.gdn import pad_packed, unpad_packed
from kernels.triton import force_triton as _force_triton

__all__ = ["store_kv", "paged_attention", "gather_kv", "causal_attention"]


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_pool: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, KVH, hd] at flat token slots (block_id * block_size + offset)."""
    if k.is_cuda or _force_triton():
        from kernels.triton.paged_attention import store_kv_triton

        return store_kv_triton(k, v, kv_pool, slot_mapping)
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (kv_pool.shape[2], kv_pool.shape[4]):
        raise ValueError(
            f"k, v must be [T, KVH={kv_pool.shape[2]}, hd={kv_pool.shape[4]}] "
            f"(got k={tuple(k.shape)}, v={tuple(v.shape)}, kv_pool={tuple(kv_pool.shape)})"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}] (got {tuple(slot_mapping.shape)})")
    bs = kv_pool.shape[3]
    blk, off = slot_mapping // bs, slot_mapping % bs
    kv_pool[blk, 0, :, off] = k.to(kv_pool.dtype)
    kv_pool[blk, 1, :, off] = v.to(kv_pool.dtype)


def gather_kv(kv_pool: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole pages of each sequence -> K, V [B, KVH, max_blocks * block_size, hd]."""
    B, nb = block_tables.shape
    _, _, kvh, bs, hd = kv_pool.shape
    pages = kv_pool.index_select(0, block_tables.reshape(-1)).reshape(B, nb, 2, kvh, bs, hd)
    pages = pages.permute(2, 0, 3, 1, 4, 5).reshape(2, B, kvh, nb * bs, hd)  # one copy of the pages
    return pages[0], pages[1]


def paged_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens over their sequence's pages. Returns [T, H, hd].
    max_len: the most new tokens of a row, when the caller knows it on the host (the Triton path
    then reads nothing back, kernels/checks.py)."""
    if q.is_cuda or _force_triton():
        from kernels.triton.paged_attention import paged_attention_triton

        return paged_attention_triton(q, kv_pool, cu_seqlens_q, seq_lens, block_tables, scale, max_len=max_len)
    check_paged_inputs(q, kv_pool, cu_seqlens_q, seq_lens, block_tables)
    B = seq_lens.numel()
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    q_max = int(q_lens.max())
    # only the pages the longest row has filled: a long prompt's table holds all its pages from
    # its first chunk on, and attending over them all cost each chunk what the last one costs
    bs = kv_pool.shape[3]
    K, V = gather_kv(kv_pool, block_tables[:, : -(-int(seq_lens.max()) // bs)])
    n_kv = K.shape[2]
    k_pos = torch.arange(n_kv, device=q.device)
    if q.shape[0] == B:  # one new token per row (decode): no padding of queries
        mask = k_pos[None, :] < seq_lens[:, None]
        o = F.scaled_dot_product_attention(
            q[:, :, None, :],
            K.to(q.dtype),
            V.to(q.dtype),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return o[:, :, 0, :]
    qp = pad_packed(q, cu_seqlens_q, q_max).transpose(1, 2)  # [B, H, q_max, hd]
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(q_max, device=q.device)[None, :]  # [B, q_max]
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # causal; also hides pages past seq_len
    o = F.scaled_dot_product_attention(
        qp, K.to(q.dtype), V.to(q.dtype), attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )
    return unpad_packed(o.transpose(1, 2), cu_seqlens_q)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of packed sequences that start here (nothing before them in the cache):
    `paged_attention` of a prefill whose every row has q_len == seq_len, read from this step's
    k, v [T, KVH, hd] rather than gathered from pages. Returns [T, H, hd]."""
    T = q.shape[0]
    B = cu_seqlens.numel() - 1
    if T % B == 0 and bool((cu_seqlens[1:] - cu_seqlens[:-1] == T // B).all()):  # one length: one call
        L = T // B
        qkv = (x.view(B, L, -1, x.shape[-1]).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(*qkv, is_causal=True, scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(T, q.shape[1], q.shape[2])
    out = []
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qkv = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        out.append(
            F.scaled_dot_product_attention(*qkv, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
        )
    return torch.cat(out)
