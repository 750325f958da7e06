"""Argument checks shared by the PyTorch and Triton paths: a wrong call raises ValueError
quoting the actual shapes, dtypes and strides; the kernels themselves check nothing.

`max_len`: a caller that knows its rows' lengths on the host (the engine builds them there) gives
the longest, and the checks then skip the one value they would read back from the device (where
cu_seqlens ends): on a GPU each such read waits for the queued work, so a step would stall once
per kernel call."""

from __future__ import annotations

import torch


def _fail(what: str, **tensors: torch.Tensor) -> None:
    desc = ", ".join(
        f"{n}={tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for n, t in tensors.items() if t is not None
    )
    raise ValueError(f"{what} (got {desc})")


STATE_DTYPES = (torch.float32, torch.bfloat16)  # GDN recurrent state pools (--mamba-ssm-cache-dtype)


def check_points_dtype(points_pool: torch.Tensor, state_pool: torch.Tensor) -> None:
    """States kept at points inside a prefill (prefix snapshots) are stored as the pool's are."""
    if points_pool.dtype != state_pool.dtype:
        _fail("points_pool must have state_pool's dtype", points_pool=points_pool, state_pool=state_pool)


def check_gdn_inputs(q, k, v, g, beta, cu_seqlens, state_pool, slot_ids, max_len: int | None = None) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3:
        _fail("q, k must be [T, Hk, dk] and v [T, Hv, dv]", q=q, k=k, v=v)
    T, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if v.shape[0] != T or hv % hk:
        _fail("v must be [T, Hv, dv] with Hv a multiple of Hk", q=q, v=v)
    if g.shape != (T, hv) or beta.shape != (T, hv):
        _fail("g and beta must be [T, Hv]", v=v, g=g, beta=beta)
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (hv, dk, dv):
        _fail(f"state_pool must be [S, Hv={hv}, dk={dk}, dv={dv}]", state_pool=state_pool)
    if state_pool.dtype not in STATE_DTYPES:
        _fail("state_pool must be float32 or bfloat16 (computed in float32 either way)", state_pool=state_pool)
    B = cu_seqlens.numel() - 1
    if cu_seqlens.dim() != 1 or B < 1 or slot_ids.shape != (B,):
        _fail("cu_seqlens must be [B+1] and slot_ids [B]", cu_seqlens=cu_seqlens, slot_ids=slot_ids)
    if max_len is None and int(cu_seqlens[-1]) != T:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but there are T={T} tokens")


def check_conv_inputs(x, weight, cu_seqlens, conv_pool, slot_ids, max_len: int | None = None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        _fail("x must be [T, D] and weight [D, Kc]", x=x, weight=weight)
    D, kc = weight.shape
    if conv_pool.dim() != 3 or tuple(conv_pool.shape[1:]) != (D, kc - 1):
        _fail(f"conv_pool must be [S, D={D}, Kc-1={kc - 1}] (channels, time)", conv_pool=conv_pool)
    if conv_pool.stride(-1) != 1:
        raise ValueError(f"conv_pool must be contiguous in time (strides {conv_pool.stride()})")
    B = cu_seqlens.numel() - 1
    if B < 1 or slot_ids.shape != (B,):
        _fail("cu_seqlens must be [B+1] and slot_ids [B]", cu_seqlens=cu_seqlens, slot_ids=slot_ids)
    if max_len is None and int(cu_seqlens[-1]) != x.shape[0]:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but there are T={x.shape[0]} tokens")


def check_paged_inputs(q, kv_pool, cu_seqlens_q, seq_lens, block_tables, max_len: int | None = None) -> None:
    if q.dim() != 3:
        _fail("q must be [T, H, hd]", q=q)
    if kv_pool.dim() != 5 or kv_pool.shape[1] != 2 or kv_pool.shape[-1] != q.shape[-1]:
        _fail("kv_pool must be [num_blocks, 2, KVH, block_size, hd]", q=q, kv_pool=kv_pool)
    if q.shape[1] % kv_pool.shape[2]:
        _fail("query heads must be a multiple of KV heads", q=q, kv_pool=kv_pool)
    B = seq_lens.numel()
    if cu_seqlens_q.shape != (B + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != B:
        _fail(
            "cu_seqlens_q must be [B+1], seq_lens [B], block_tables [B, max_blocks]",
            cu_seqlens_q=cu_seqlens_q,
            seq_lens=seq_lens,
            block_tables=block_tables,
        )
    if max_len is None and int(cu_seqlens_q[-1]) != q.shape[0]:
        raise ValueError(f"cu_seqlens_q ends at {int(cu_seqlens_q[-1])} but q has {q.shape[0]} tokens")


def check_fp8_block(w, scale_inv, block_size) -> tuple[int, int]:
    """w [..., N, K] float8_e4m3fn and scale_inv [..., ceil(N/bn), ceil(K/bk)] float32 in blocks
    block_size = (bn, bk); returns (bn, bk)."""
    if block_size is None or len(block_size) != 2 or min(block_size) < 1:
        raise ValueError(f"block_size must be (bn, bk) >= 1 (got {block_size})")
    bn, bk = (int(b) for b in block_size)
    if w.dim() < 2 or w.dtype != torch.float8_e4m3fn:
        _fail("w must be a float8_e4m3fn [..., N, K] tensor", w=w)
    want = (*w.shape[:-2], -(-w.shape[-2] // bn), -(-w.shape[-1] // bk))
    if scale_inv is None or tuple(scale_inv.shape) != want or scale_inv.dtype != torch.float32:
        got = "None" if scale_inv is None else f"{tuple(scale_inv.shape)}:{scale_inv.dtype}"
        raise ValueError(f"scale_inv must be float32 {want} for w {tuple(w.shape)} in blocks ({bn}, {bk}) (got {got})")
    return bn, bk


def check_moe_inputs(
    x, w13, w2, topk_weights, topk_ids, w13_scale_inv=None, w2_scale_inv=None, block_size=None
) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        _fail("x must be [T, H], w13 [E, 2*I, H] and w2 [E, H, I]", x=x, w13=w13, w2=w2)
    T, H = x.shape
    E, two_i, _ = w13.shape
    if two_i % 2 or tuple(w13.shape) != (E, two_i, H) or tuple(w2.shape) != (E, H, two_i // 2):
        _fail(f"w13 must be [E, 2*I, H={H}] and w2 [E, H={H}, I]", x=x, w13=w13, w2=w2)
    if w13_scale_inv is not None or w2_scale_inv is not None:
        check_fp8_block(w13, w13_scale_inv, block_size)
        check_fp8_block(w2, w2_scale_inv, block_size)
    elif w13.dtype != x.dtype or w2.dtype != x.dtype:
        _fail("w13 and w2 must have x's dtype (or be float8_e4m3fn with scales)", x=x, w13=w13, w2=w2)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        _fail(f"topk_weights and topk_ids must be [T={T}, k]", topk_weights=topk_weights, topk_ids=topk_ids)
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        _fail("topk_ids must be int64 (or int32), topk_weights float32", topk_weights=topk_weights, topk_ids=topk_ids)
