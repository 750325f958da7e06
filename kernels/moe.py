"""Mixture-of-experts ops (Qwen3.5-MoE, Qwen3-Next): `select_experts` (softmax, top-k,
renormalised as the architecture says) and `fused_moe` (the routed experts over stacked w13 / w2,
a TP rank's slice of each); sorted per-expert GEMMs on the CPU, rounding where transformers
rounds, Triton on CUDA (docs/kernels.md, "Module notes")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.checks import check_moe_inputs
from kernels.fp8 import dequant_fp8_block
from kernels.triton import force_triton as _force_triton

__all__ = ["select_experts", "fused_moe", "sort_by_expert"]

# A 16-bit expert with at least this many rows runs its GEMMs in float32 on a float32 copy of
# its weights: CPUs without bf16 units (AVX2) take ~1 row per GEMV pass in bf16, while the copy
# costs about one such pass and the float32 GEMM blocks all rows. The result is the same
# float32-accumulated GEMM, rounded once to x's dtype.
_UPCAST_ROWS = 2
# ... but while the active experts average fewer rows than this, most have one and the copies
# cost more than they save: one grouped call of 16-bit GEMMs is faster (measured with
# Qwen3.5-35B-A3B's expert sizes, bench/moe.py).
_UPCAST_MEAN_ROWS = 2.5
# With at most this many rows on every active expert, bfloat16 experts take the C GEMV
# (kernels/cpu_ops.py), which reads each weight once for all its rows.
_GEMV_ROWS = 4
_GEMV_THREADED = 1 << 20  # expert weights of at least this many elements split over torch's threads


def _grouped_gemm_ok(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, rows: list[int]) -> bool:
    """Whether torch's grouped GEMM should run these experts (rows[e] rows each): it exists on
    this build, needs 16-byte aligned pointers and strides, and runs 16-bit GEMMs without the
    float32 copies."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x.dtype != torch.float32 and sum(rows) >= _UPCAST_MEAN_ROWS * sum(1 for r in rows if r):
        return False
    for t in (w13, w2):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]):
            return False
    return x.shape[1] * x.element_size() % 16 == 0 and w2.shape[2] * x.element_size() % 16 == 0


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64), highest
    probability first."""
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        got = f"{tuple(router_logits.shape)}:{router_logits.dtype}"
        raise ValueError(f"router_logits must be a float [T, E] tensor (got {got})")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k must be in [1, E={router_logits.shape[1]}] (got {top_k})")
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T*k], counts [E]): the flat pair indices t*k + j sorted by expert id (stable),
    and the number of pairs per expert. Raises ValueError for an id outside [0, E)."""
    flat = topk_ids.reshape(-1)
    try:
        counts = torch.bincount(flat, minlength=num_experts)
    except RuntimeError:  # a negative id
        counts = None
    if counts is None or counts.numel() != num_experts:
        raise ValueError(f"topk_ids must be in [0, E={num_experts}) (got min {int(flat.min())}, max {int(flat.max())})")
    return torch.argsort(flat, stable=True), counts


def _gemm(x: torch.Tensor, w: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    """x [n, K] @ w[N, K]^T in x's dtype; through a float32 copy of w (buf) when given."""
    if buf is None:
        return F.linear(x, w)
    return F.linear(x.float(), buf.copy_(w)).to(x.dtype)


def _expert(xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, bufs) -> torch.Tensor:
    """One expert's SwiGLU MLP over its rows: xs [n, H] -> [n, H] in xs's dtype."""
    upcast = bufs is not None and xs.shape[0] >= _UPCAST_ROWS
    h = _gemm(xs, w13, bufs[0] if upcast else None)
    i = w2.shape[1]
    act = F.silu(h[:, :i], inplace=True).mul_(h[:, i:])
    return _gemm(act, w2, bufs[1] if upcast else None)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    row_invariant: bool = False,
) -> torch.Tensor:
    """The routed experts' weighted sum for each token: [T, H] in x's dtype (see the module).

    FP8 experts: w13 and w2 float8_e4m3fn with w13_scale_inv [E, ceil(2I/bn), ceil(H/bk)] and
    w2_scale_inv [E, ceil(H/bn), ceil(I/bk)] in blocks block_size (kernels/fp8.py); each active
    expert is dequantized into x's dtype as it is used.
    row_invariant (--batch-invariant): every expert through the C GEMV, whose sums for a row do
    not depend on how many rows the expert has, so a token's result does not depend on its step
    (bfloat16 experts on the CPU; on CUDA the Triton kernels at one fixed block of rows).
    """
    if x.is_cuda or _force_triton():
        from kernels.triton.moe import fused_moe_triton

        args = (x, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv, block_size)
        return fused_moe_triton(*args, row_invariant=row_invariant)
    check_moe_inputs(x, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv, block_size)
    if row_invariant and not (
        x.dtype == w13.dtype == w2.dtype == torch.bfloat16 and w13.is_contiguous() and w2.is_contiguous()
    ):
        raise ValueError(
            f"batch-invariant experts run contiguous bfloat16 weights (got x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}); "
            "load the checkpoint in bfloat16 with --fp8-experts dequantize, or leave --batch-invariant off"
        )
    T, H = x.shape
    k = topk_ids.shape[1]
    order, counts = sort_by_expert(topk_ids, w13.shape[0])
    xs = x.index_select(0, torch.div(order, k, rounding_mode="trunc"))  # [T*k, H] rows grouped by expert
    ws = topk_weights.reshape(-1).index_select(0, order).to(x.dtype).float()[:, None]  # rounded as transformers rounds
    rows = counts.tolist()
    if row_invariant or (w13_scale_inv is None and _gemv_ok(x, w13, w2, rows)):
        ys = _experts_gemv(xs, ws, rows, w13, w2)
    elif w13_scale_inv is None and _grouped_gemm_ok(x, w13, w2, rows):
        offs = counts.cumsum(0, dtype=torch.int32)
        h = F.grouped_mm(xs, w13.transpose(1, 2), offs=offs)
        i = w2.shape[2]
        act = F.silu(h[:, :i], inplace=True).mul_(h[:, i:])
        ys = torch.mul(F.grouped_mm(act, w2.transpose(1, 2), offs=offs), ws)
    else:
        ys = _experts_one_by_one(xs, ws, rows, w13, w2, w13_scale_inv, w2_scale_inv, block_size)
    pairs = torch.empty_like(ys).index_copy_(0, order, ys)  # back to (token, j) order
    return pairs.view(T, k, H).sum(1).to(x.dtype)


def _gemv_ok(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, rows: list[int]) -> bool:
    """bfloat16 experts with few rows each (decode): the C GEMV reads each active expert's
    bfloat16 weight once for all its rows, where the 16-bit GEMMs on AVX2 take a pass per row."""
    return (
        x.dtype == torch.bfloat16
        and max(rows) <= _GEMV_ROWS
        and w13.is_contiguous()
        and w2.is_contiguous()
        and cpu_ops.available(x.dtype)
    )


def _experts_gemv(xs, ws, rows, w13, w2) -> torch.Tensor:
    """As `_experts_one_by_one` for bfloat16 experts through `cpu_ops.gemv_bf16` (float32
    accumulation, each GEMM's output rounded to bfloat16 once, as a bfloat16 F.linear's)."""
    ys = torch.empty(xs.shape, dtype=torch.float32)
    i = w2.shape[2]
    nt = torch.get_num_threads() if w13[0].numel() >= _GEMV_THREADED else 1
    for e, (x_e, w_e, y_e) in enumerate(zip(xs.split(rows), ws.split(rows), ys.split(rows))):
        if x_e.shape[0]:
            h = cpu_ops.gemv_bf16(x_e, w13[e], torch.bfloat16, nt)
            act = F.silu(h[:, :i], inplace=True).mul_(h[:, i:])
            torch.mul(cpu_ops.gemv_bf16(act, w2[e], torch.bfloat16, nt), w_e, out=y_e)
    return ys


def _experts_one_by_one(xs, ws, rows, w13, w2, w13_scale_inv, w2_scale_inv, block_size) -> torch.Tensor:
    """Rows xs [P, H] grouped by expert (rows[e] of expert e) through their experts, times ws
    [P, 1]: [P, H] float32."""
    bufs = None
    if xs.dtype != torch.float32 and max(rows) >= _UPCAST_ROWS:
        bufs = (torch.empty(w13.shape[1:], dtype=torch.float32), torch.empty(w2.shape[1:], dtype=torch.float32))
    ys = torch.empty(xs.shape, dtype=torch.float32)
    for e, (x_e, w_e, y_e) in enumerate(zip(xs.split(rows), ws.split(rows), ys.split(rows))):
        if x_e.shape[0]:
            w13_e, w2_e = w13[e], w2[e]
            if w13_scale_inv is not None:
                w13_e = dequant_fp8_block(w13_e, w13_scale_inv[e], block_size, xs.dtype)
                w2_e = dequant_fp8_block(w2_e, w2_scale_inv[e], block_size, xs.dtype)
            torch.mul(_expert(x_e, w13_e, w2_e, bufs), w_e, out=y_e)
    return ys
