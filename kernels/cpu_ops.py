"""Fused CPU ops of the decode step as torch operators (`torch.ops.pdserve.*`, kernels/csrc/),
built at install time by `python -m kernels.build`. Each wrapper names its PyTorch reference in
kernels/ (the fallback and the tests' reference); without the library the engine runs that path
and a WARNING says why and how to build it. docs/cpu.md, "Module notes"."""

from __future__ import annotations

import functools
import json
import logging
import os
import threading

import torch

__all__ = [
    "available",
    "status",
    "gdn_decode",
    "gdn_rows",
    "add_rms_norm",
    "gemv_bf16",
    "attn_decode",
    "pack_f32",
    "gemm_f32",
    "pack_bf16",
    "gemm_bf16",
    "bf16_dot_supported",
    "silu_mul",
    "gdn_verify",
    "mask_logits",
    "masked_argmax",
    "topk",
    "top_p_draw",
]

_log = logging.getLogger("pdserve.kernels")
_lock = threading.Lock()
_state: str | None = None  # None: not tried; "" loaded; else why not


def _why_not() -> str:
    """Loads the operator library; returns "" or the reason it is not used."""
    from kernels import build  # here: `python -m kernels.build` must not find it imported already

    if os.environ.get("PDSERVE_CPU_OPS", "1") == "0":
        return "PDSERVE_CPU_OPS=0"
    if not build.LIB.exists() or not build.META.exists():
        return f"{build.LIB} is not built"
    try:
        meta = json.loads(build.META.read_text())
    except (OSError, ValueError) as e:
        return f"{build.META} is unreadable ({e})"
    if meta.get("sources") != build.source_digest():
        return f"{build.LIB} was built from other sources than kernels/csrc/ holds now"
    if meta.get("torch") != torch.__version__:
        return f"{build.LIB} was built against torch {meta.get('torch')}, this is torch {torch.__version__}"
    try:
        torch.ops.load_library(str(build.LIB))
    except (OSError, RuntimeError) as e:
        return f"loading {build.LIB} failed ({e})"
    return ""


def status() -> str:
    """ "" when the operators are loaded, else the reason they are not."""
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                why = _why_not()
                from kernels.build import COMMAND

                if why == "PDSERVE_CPU_OPS=0":
                    _log.info("CPU operators off (PDSERVE_CPU_OPS=0): the CPU decode step runs on the PyTorch path")
                elif why:
                    _log.warning(
                        "CPU operators not loaded: %s. The CPU decode step runs on the PyTorch path (slower); "
                        "build them with `%s` (`make` does it).",
                        why,
                        COMMAND,
                    )
                _state = why
    return _state


def available(dtype: torch.dtype | None = None) -> bool:
    """True when the operators are loaded and handle this dtype (float32, bfloat16)."""
    return (dtype is None or dtype in (torch.float32, torch.bfloat16)) and status() == ""


def _ops():
    """torch.ops.pdserve, loaded; RuntimeError with the reason when it cannot be."""
    why = status()
    if why:
        raise RuntimeError(f"the CPU operators are not loaded: {why}")
    return torch.ops.pdserve


def gdn_decode(proj, conv_w, conv_pool, rec_pool, slots, neg_A, dt_bias, norm_w, hk, hv, dk, dv, eps) -> torch.Tensor:
    """One token per row through a GDN layer after its input projection.

    proj [B, D + Hv*dv + 2*Hv] rows [qkv | z | b | a] (model dtype, unit stride on the last axis),
    conv_w [D, Kc], conv_pool [S, D, Kc-1] (model dtype), rec_pool [S, Hv, dk, dv] float32 (or
    bfloat16: the rows' state is gathered, widened, and stored back rounded once),
    slots [B] int64 (distinct), neg_A / dt_bias [Hv] float32, norm_w [dv]. Updates the rows'
    slots in place and returns the gated-normed output [B, Hv*dv] in the model dtype. Rows are
    split over torch's threads. Reference: kernels.conv_update_, gdn_decode_step_, gated_rms_norm.
    """
    if rec_pool.dtype != torch.float32:  # a bfloat16 state: the operator runs on the rows' state widened
        conv, rec, local, store = _widened(conv_pool, rec_pool, slots)
        out = _ops().gdn_decode(proj, conv_w, conv, rec, local, neg_A, dt_bias, norm_w, hk, hv, dk, dv, eps)
        store()
        return out
    return _ops().gdn_decode(proj, conv_w, conv_pool, rec_pool, slots, neg_A, dt_bias, norm_w, hk, hv, dk, dv, eps)


def _widened(conv_pool: torch.Tensor, rec_pool: torch.Tensor, slots: torch.Tensor):
    """For a recurrent pool in bfloat16 (--mamba-ssm-cache-dtype): (the rows' conv state, their
    recurrent state in float32, local slot ids 0..B-1, a function that stores both back into
    the pools, rounding the recurrent state once). The operators take float32 state only."""
    conv, rec = conv_pool.index_select(0, slots), rec_pool.index_select(0, slots).float()

    def store() -> None:
        conv_pool.index_copy_(0, slots, conv)
        rec_pool.index_copy_(0, slots, rec.to(rec_pool.dtype))

    return conv, rec, torch.arange(len(slots), dtype=slots.dtype), store


def add_rms_norm(x: torch.Tensor, h: torch.Tensor | None, w: torch.Tensor, eps: float):
    """x, h [T, H] model dtype (contiguous), w [H] float32 (the 1 + w of a zero-centred norm).
    Returns (x + h rounded to the model dtype, its RMS norm times w), both new tensors; with h
    None, (x, the norm of x). Reference: kernels.norm.rms_norm."""
    if h is None:
        return x, _ops().rms_norm(x, w, eps)
    return _ops().add_rms_norm(x, h, w, eps)


def gemv_bf16(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, threads: int = 1) -> torch.Tensor:
    """x [M, K] (any float dtype) @ w [N, K]^T for a contiguous bfloat16 w, float32 arithmetic;
    returns [M, N] in out_dtype (float32 or bfloat16). For a few rows (decode). Reference: F.linear."""
    return _ops().gemv_bf16(x.float().contiguous(), w, out_dtype, threads)


def attn_decode(
    qkv, qk_norm, eps, cos, sin, kv_pool, slot_mapping, block_tables, seq_lens, h, kvh, scale, seq_starts=None
):
    """One token per row through a gated attention layer after its qkv projection.

    qkv [B, >= 2*(H+KVH)*hd] rows [q | k | gate | v] (model dtype, unit stride on the last axis),
    qk_norm [H+KVH, hd] float32 (1 + w of q_norm per query head, then of k_norm per KV head),
    cos, sin [B, rd] (or [B, 1, rd]) the rotary tables at the rows' positions, kv_pool the
    kernels' view [num_blocks, 2, KVH, bs, hd] (any strides, unit stride on hd, model dtype),
    slot_mapping / seq_lens [B] int64, block_tables [B, max_blocks] int64. Writes the new k, v
    to their pages and returns attention(q, pages) * sigmoid(gate) [B, H*hd] in the model dtype.
    Reference: kernels.attention (store_kv, paged_attention) as engine/model/layers.py calls it.

    seq_starts [S+1] int64 (optional): rows that are consecutive tokens of one sequence (a
    speculative row, an MTP chunk), rows seq_starts[i] .. seq_starts[i+1]-1 each; block_tables,
    seq_lens and slot_mapping stay per row. A sequence's rows run in order on one thread, so
    each attends to the k, v of the rows before it: causal attention within the sequence.
    """
    B, rd = qkv.shape[0], cos.shape[-1]
    if seq_starts is not None:
        seq_starts = seq_starts.to(torch.int64).contiguous()
    return _ops().attn_decode(
        qkv,
        qk_norm.contiguous(),
        eps,
        cos.reshape(B, rd).contiguous(),
        sin.reshape(B, rd).contiguous(),
        kv_pool,
        slot_mapping,
        block_tables.contiguous(),
        seq_lens,
        h,
        kvh,
        scale,
        seq_starts,
    )


def pack_f32(w: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] packed for `gemm_f32`: [ceil(N/16), K, 16], panels of 16 output
    columns (the last one zero-padded)."""
    return _ops().pack_f32(w.float().contiguous())


def gemm_f32(x: torch.Tensor, wp: torch.Tensor, n: int, threads: int = 1) -> torch.Tensor:
    """x [M, K] float32 @ w^T for wp = pack_f32(w [n, K]): y [M, n] float32, output panels split
    over `threads` threads. For a decode step's few rows. Reference: F.linear(x, w)."""
    return _ops().gemm_f32(x.contiguous(), wp, n, threads)


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight [N, K] packed for `gemm_bf16`: [ceil(N/16), ceil(K/2), 16, 2], panels of 16
    output columns in pairs of k (zero past N and K)."""
    return _ops().pack_bf16(w.contiguous())


@functools.cache
def bf16_dot_supported() -> bool:
    """Whether this CPU has AVX512-BF16 (VDPBF16PS), which `gemm_bf16` uses when it does."""
    return bool(_ops().bf16_dot_supported())


def gemm_bf16(x: torch.Tensor, wp: torch.Tensor, n: int, threads: int = 1, dot: bool | None = None) -> torch.Tensor:
    """x [M, K] bfloat16 @ w^T for wp = pack_bf16(w [n, K]): y [M, n] bfloat16, each row the same
    float32 sum in the same order whatever M is (kernels/csrc/gemm_bf16.cpp defines it: VDPBF16PS's
    steps, the odd k of a pair first). `dot`: the instruction (default: where the CPU has it) or
    float32 multiply-adds; the same bits. Reference: F.linear(x.float(), w.float()).bfloat16()."""
    return _ops().gemm_bf16(x.contiguous(), wp, n, threads, bf16_dot_supported() if dot is None else dot)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [M, 2I] float32 or bfloat16 (unit stride on the last axis) -> silu(gu[:, :I]) *
    gu[:, I:] [M, I] in its dtype (bfloat16: the silu rounded before the product, as
    F.silu(gate).mul_(up) rounds): the MLP's gate in one pass (engine/model/layers.py MLP is the
    reference), rows split over torch's threads when there are many."""
    return _ops().silu_mul(gu)


def mask_logits(x: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: x[rows[r], t] = -inf where bit t % 32 of bitmask[r, t // 32] is 0. x [N, V]
    float32 or bfloat16 (unit stride on the last axis), bitmask [R, ceil(V / 32)] int32
    contiguous, rows [R] int64 distinct. Rows split over torch's threads when there are many.
    Reference: engine/structured/bitmask.py forbidden + masked_fill_."""
    _ops().mask_logits(x, bitmask, rows)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest of x [N, V] (float32 or bfloat16, unit stride on the last axis), as
    (values float32 [N, k] descending, ids int64 [N, k]): ties to the lower id, NaN as -inf, one
    pass over each row. Reference: engine/sampling/filters.py topk_reference (a stable sort)."""
    return _ops().topk(x, k)  # type: ignore[no-any-return]


def top_p_draw(
    p: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p [N, V] float32 probabilities (a softmax's rows, unit stride on the last axis); top_p (in
    (0, 1]), min_p and u (in [0, 1)) float32 [N] -> (tokens int64 [N], cut int64 [N, 2], largest
    float32 [N]): each row's kept set as engine/sampling/cut.py `kept` finds it (min-p, then top-p
    over what it keeps, ties to the lower id), without a sort; the token the inverse CDF of the
    kept probabilities in id order draws at u (engine/sampling/filters.py inverse_cdf; V where a
    row keeps no mass or holds a NaN); and the row's largest probability. A row keeps the tokens
    whose probability's int32 bits are above cut[r, 0], or equal to them with an id below
    cut[r, 1]. Rows split over torch's threads. Reference: `cut.kept`, then `inverse_cdf`."""
    return _ops().top_p_draw(p, top_p, min_p, u)  # type: ignore[no-any-return]


def masked_argmax(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """[N] int64: each row's first largest value of x [N, V] (float32 or bfloat16, unit stride on
    the last axis) among the tokens bitmask [N, ceil(V / 32)] int32 allows (0 where it allows
    none); x is not written. Reference: mask_logits, then x.max(-1).indices."""
    return _ops().masked_argmax(x, bitmask)  # type: ignore[no-any-return]


def gdn_rows(
    proj,
    row_cu,
    row_slots,
    row_init,
    tok_slots,
    conv_w,
    conv_pool,
    rec_pool,
    neg_A,
    dt_bias,
    norm_w,
    hk,
    hv,
    dk,
    dv,
    eps,
) -> torch.Tensor:
    """A GDN layer after its input projection for rows of any length (decode rows, prefill
    chunks, both), token by token in the recurrent form (`gdn_decode` per token).

    proj [T, D + Hv*dv + 2*Hv] rows [qkv | z | b | a]; row_cu [R+1] int64 token offsets of the
    rows; row_slots [R] int64 (distinct); row_init [R] bool (False: the row starts from zero
    state); tok_slots [T] int64 each token's slot; the rest as `gdn_decode`. Returns [T, Hv*dv]
    and leaves each row's final conv and recurrent state in its slot (kernels/gdn.py's
    gdn_chunk_prefill / causal_conv1d compute the same). Rows are split over threads.
    """
    store = None
    if rec_pool.dtype != torch.float32:  # a bfloat16 state: on the rows' state widened (`_widened`)
        conv_pool, rec_pool, local, store = _widened(conv_pool, rec_pool, row_slots)
        row_slots, tok_slots = local, local.repeat_interleave(row_cu[1:] - row_cu[:-1])
    out = _ops().gdn_rows(
        proj,
        row_cu,
        row_slots,
        row_init,
        tok_slots,
        conv_w,
        conv_pool,
        rec_pool,
        neg_A,
        dt_bias,
        norm_w,
        hk,
        hv,
        dk,
        dv,
        eps,
    )
    if store is not None:
        store()
    return out


def gdn_rows_points(proj, rows, conv_w, conv_pool, rec_pool, consts, points, snap_conv, snap_rec) -> torch.Tensor:
    """`gdn_rows` that also keeps the states at points inside the rows (prefix snapshots), in the
    same pass: rows = (row_cu, row_slots, row_init, tok_slots), consts = (neg_A, dt_bias, norm_w,
    hk, hv, dk, dv, eps) as `gdn_rows`; points = (pt_ptr [R+1], pt_off [M], pt_dest [M]) int64:
    row r's points are [pt_ptr[r], pt_ptr[r+1]), offsets ascending, and the state after pt_off
    tokens of the row goes to entry pt_dest of snap_conv [E, D, Kc-1] (the conv pool's dtype) and
    snap_rec [E, Hv, dk, dv] float32. A float32 recurrent pool and dk, dv multiples of 8
    (`points_in_pass`). Reference: `gdn_rows` cut at the points, each piece's end state copied."""
    return _ops().gdn_rows_points(proj, *rows, conv_w, conv_pool, rec_pool, *consts, *points, snap_conv, snap_rec)


def points_in_pass(rec_pool: torch.Tensor, dk: int, dv: int) -> bool:
    """Whether `gdn_rows_points` takes these states (else gdn_rows in pieces cut at the points)."""
    return rec_pool.dtype == torch.float32 and dk % 8 == 0 and dv % 8 == 0


def gdn_verify(
    proj,
    conv_w,
    conv_pool,
    rec_pool,
    slots,
    cu_seqlens,
    conv_scratch,
    rec_scratch,
    neg_A,
    dt_bias,
    norm_w,
    hk,
    hv,
    dk,
    dv,
    eps,
) -> torch.Tensor:
    """Decode rows of 1..n tokens each (a pending token and its drafts) through a GDN layer:
    `gdn_decode` token by token on each row's slot, keeping the state after every token but a
    row's last in its scratch entries, for rollback.

    proj [T, D + Hv*dv + 2*Hv] packed over the rows (cu_seqlens [B+1] int64), slots [B] int64,
    conv_scratch [>= B, n1, D, Kc-1] model dtype and rec_scratch [>= B, n1, Hv, dk, dv] float32
    (entry [b, j]: row b after its token j, for j < len_b - 1; n1 >= the longest row), the rest
    as for `gdn_decode`. Returns the gated-normed output [T, Hv*dv] in the model dtype.
    Reference: kernels.gdn_recurrent with its scratch (engine/model/layers.py).
    """
    return _ops().gdn_verify(
        proj,
        conv_w,
        conv_pool,
        rec_pool,
        slots,
        cu_seqlens,
        conv_scratch,
        rec_scratch,
        neg_A,
        dt_bias,
        norm_w,
        hk,
        hv,
        dk,
        dv,
        eps,
    )
