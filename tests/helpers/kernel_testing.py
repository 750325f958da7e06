"""Helpers shared by the kernel tests: a comparison that names the tensor and its relative
error and never lets NaN through, NaN poisoning, and slot-pool bookkeeping."""

from __future__ import annotations

import torch

# Triton (or PyTorch) vs the PyTorch reference, by activation dtype.
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
# PyTorch reference vs the naive float64 loop (float32 inputs).
NAIVE_TOL = 1e-5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (0 when both are all zero)."""
    g, r = got.detach().double().cpu(), ref.detach().double().cpu()
    err = (g - r).abs().max().item() if g.numel() else 0.0
    scale = r.abs().max().item() if r.numel() else 0.0
    return err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Fail unless got matches ref within relative error tol; any NaN or inf fails."""
    assert tuple(got.shape) == tuple(ref.shape), f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    for what, t in (("result", got), ("reference", ref)):
        bad = (~torch.isfinite(t.detach().float())).sum().item()
        assert bad == 0, f"{name}: {what} has {bad} non-finite values of {t.numel()}"
    e = rel_err(got, ref)
    assert e < tol, f"{name}: relative error {e:.3e} >= {tol:.0e}"


def assert_unchanged(name: str, after: torch.Tensor, before: torch.Tensor) -> None:
    """Bit-for-bit equality (NaN == NaN)."""
    a, b = after.detach().cpu().contiguous(), before.detach().cpu().contiguous()
    assert a.shape == b.shape and a.dtype == b.dtype, (
        f"{name}: {tuple(b.shape)}:{b.dtype} -> {tuple(a.shape)}:{a.dtype}"
    )
    same = a.flatten().view(torch.uint8) == b.flatten().view(torch.uint8)
    assert bool(same.all()), f"{name}: {int((~same).sum())} bytes changed that must not"


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def cu_seqlens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0)


def pick_slots(n_slots: int, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_ids [batch], untouched slot ids): a random subset of the pool, in random order."""
    perm = torch.randperm(n_slots, generator=gen)
    return perm[:batch].clone(), perm[batch:].clone()


def head_major(pool: torch.Tensor) -> torch.Tensor:
    """The same pool [num_blocks, 2, KVH, bs, hd] as a view of head-major storage
    [KVH, num_blocks, 2, bs, hd], the engine's layout (strides differ, values do not)."""
    return pool.permute(2, 0, 1, 3, 4).contiguous().permute(1, 2, 0, 3, 4)


def to_dev(*xs):
    return tuple(None if x is None else x.to(DEVICE) for x in xs)


def attn_rows_case(g: torch.Generator, dtype, h: int, kvh: int, hd: int, rd: int, bs: int, lens, ctx, nblocks, width):
    """Inputs of cpu_ops.attn_decode for rows of sequences: sequence i's `lens[i]` new tokens end
    at position `ctx[i]`, its pages a random row of `tables`. Returns a dict: qkv, qk_norm, pool
    (the kernels' view of a random head-major pool), tables [S, width], seq (each row's sequence),
    pos, slots, cos, sin [B, rd], starts (seq_starts)."""
    from engine.cache.allocator import kv_pool_view

    B, S = sum(lens), len(lens)
    qkv = torch.randn(B, 2 * (h + kvh) * hd, generator=g).to(dtype)
    qk_norm = 1 + 0.1 * torch.randn(h + kvh, hd, generator=g)
    pool = kv_pool_view(torch.randn(kvh, nblocks, 2, bs, hd, generator=g).to(dtype))
    tables = torch.randperm(nblocks, generator=g)[: S * width].view(S, width)
    seq = torch.repeat_interleave(torch.arange(S), torch.tensor(lens))
    pos = torch.cat([torch.arange(c - n, c) for n, c in zip(lens, ctx)])
    slots = tables[seq, pos // bs] * bs + pos % bs
    ang = pos[:, None].float() * torch.rand(rd // 2, generator=g)[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return dict(qkv=qkv, qk_norm=qk_norm, pool=pool, tables=tables, seq=seq, pos=pos, slots=slots, cos=cos, sin=sin,
                starts=starts)  # fmt: skip
