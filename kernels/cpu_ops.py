"""Fused CPU ops of the decode step, in C (`csrc/cpu_ops.c`), built on first use.

A decode step is hundreds of small eager ops; on a CPU their dispatch costs more than their
arithmetic at small batches. These ops do one GDN layer's decode (conv update, q/k L2 norm,
gates, the delta-rule step on the slot's state, gated RMS norm) and a residual add + RMS norm
in one call each, in float32 arithmetic with values rounded to bfloat16 where transformers'
eager model rounds them (docs/ARCHITECTURE.md, "CPU decode").

The C file is compiled once per machine with the system C compiler (`$CC`, else `cc`;
`-O3 -march=native`) into `$PDSERVE_HOME/kernels` (default `~/.cache/pdserve/kernels`), named
by a hash of the source, flags and CPU, and loaded with ctypes (calls release the GIL). No
compiler, a failed build, or `PDSERVE_CPU_OPS=0` leaves `available()` False and the engine on
its PyTorch path, which computes the same thing op by op.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = [
    "available",
    "gdn_decode",
    "gdn_rows",
    "add_rms_norm",
    "gemv_bf16",
    "attn_decode",
    "pack_f32",
    "gemm_f32",
    "silu_mul",
    "threads",
    "gdn_verify",
]

_SRC = Path(__file__).with_name("csrc") / "cpu_ops.c"
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-pthread"]
_log = logging.getLogger("pdserve.kernels")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False

_i64, _p, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGS = {
    "gdn_decode": [_i64] * 7 + [_p, _i64, _p, _p, _p, _p, _p, _p, _p, _f32, _p, _p, _int],
    "add_rms_norm": [_i64, _i64, _i64, _p, _p, _p, _p, _f32, _p, _p, _int],
    "add_rms_norm_mt": [_i64, _i64, _p, _p, _p, _p, _f32, _p, _int, _i64],
    "gemv_bf16": [_i64, _i64, _i64, _p, _p, _p, _int, _i64],
    "attn_decode": [
        *[_i64] * 5,
        _p,
        _i64,
        _p,
        _f32,
        _p,
        _p,
        _p,
        *[_i64] * 5,
        _p,
        _p,
        _i64,
        _p,
        _f32,
        _p,
        _p,
        _i64,
        _int,
        _i64,
        _p,
        _i64,
    ],
    "pack_f32": [_i64, _i64, _p, _p],
    "gdn_rows_mt": [
        _i64,
        _p,
        _p,
        _p,
        _p,
        *[_i64] * 5,
        _p,
        _i64,
        _p,
        _p,
        _p,
        _p,
        _p,
        _p,
        _f32,
        _p,
        _p,
        _i64,
        _int,
        _i64,
    ],
    "gemm_f32": [_i64, _i64, _i64, _p, _p, _p, _i64],
    "silu_mul_f32": [_i64, _i64, _p, _i64, _p, _i64],
    "gdn_decode_mt": [_i64] * 6 + [_p, _i64, _p, _p, _p, _p, _p, _p, _p, _f32, _p, _p, _i64, _int, _i64],
    "gdn_verify": [_i64, _p] + [_i64] * 5 + [_p, _i64, _p, _p, _p, _p, _p, _p, _p, _f32, _p, _p, _int, _p, _p, _i64],
}


def _cpu_id() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build() -> ctypes.CDLL | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        _log.info("no C compiler: the decode step stays on the PyTorch path")
        return None
    src = _SRC.read_bytes()
    key = hashlib.sha256(src + " ".join(_FLAGS).encode() + _cpu_id().encode()).hexdigest()[:16]
    home = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))
    out = home / "kernels" / f"cpu_ops-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        r = subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SRC), "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            os.unlink(tmp)
            _log.warning("building %s failed, the decode step stays on the PyTorch path:\n%s", _SRC.name, r.stderr)
            return None
        os.replace(tmp, out)  # atomic: concurrent builders each write their own file
    lib = ctypes.CDLL(str(out))
    for name, args in _SIGS.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    return lib


def _get() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                if os.environ.get("PDSERVE_CPU_OPS", "1") != "0":
                    try:
                        _lib = _build()
                    except OSError as e:
                        _log.warning("loading the CPU ops failed (%s): the decode step stays on the PyTorch path", e)
                _tried = True
    return _lib


def available(dtype: torch.dtype | None = None) -> bool:
    """True when the C ops are built and handle this dtype (float32, bfloat16)."""
    return (dtype is None or dtype in (torch.float32, torch.bfloat16)) and _get() is not None


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def threads(rows: int) -> int:
    """Threads a C op of the decode step splits `rows` rows over: torch's intra-op threads, one
    per row at most (a thread costs a few microseconds to start)."""
    return max(1, min(torch.get_num_threads(), rows, 8))


def gdn_decode(proj, conv_w, conv_pool, rec_pool, slots, neg_A, dt_bias, norm_w, hk, hv, dk, dv, eps) -> torch.Tensor:
    """One token per row through a GDN layer after its input projection.

    proj [B, D + Hv*dv + 2*Hv] rows [qkv | z | b | a] (model dtype, unit stride on the last axis),
    conv_w [D, Kc], conv_pool [S, D, Kc-1] (model dtype), rec_pool [S, Hv, dk, dv] float32,
    slots [B] int64 (distinct), neg_A / dt_bias [Hv] float32, norm_w [dv]. Updates the rows'
    slots in place and returns the gated-normed output [B, Hv*dv] in the model dtype. Rows are
    split over `threads(B)` threads.
    """
    B, dtype = proj.shape[0], proj.dtype
    D, kc = conv_w.shape
    assert proj.stride(1) == 1 and conv_pool.is_contiguous() and rec_pool.is_contiguous()
    assert (
        conv_pool.dtype == dtype and conv_w.dtype == dtype and norm_w.dtype == dtype and rec_pool.dtype == torch.float32
    )
    out = torch.empty(B, hv * dv, dtype=dtype)
    nt = threads(B)
    stride = D + 2 * hv
    work = torch.empty(nt * stride, dtype=torch.float32)
    _get().gdn_decode_mt(
        B, hk, hv, dk, dv, kc, _ptr(proj), proj.stride(0), _ptr(conv_w), _ptr(conv_pool), _ptr(rec_pool),
        _ptr(slots), _ptr(neg_A), _ptr(dt_bias), _ptr(norm_w), eps, _ptr(out), _ptr(work), stride,
        int(dtype == torch.bfloat16), nt,
    )  # fmt: skip
    return out


def add_rms_norm(x: torch.Tensor, h: torch.Tensor | None, w: torch.Tensor, eps: float):
    """x, h [T, H] model dtype (contiguous), w [H] float32 (the 1 + w of a zero-centred norm).
    Returns (x + h rounded to the model dtype, its RMS norm times w), both new tensors; with h
    None, (x, the norm of x)."""
    T, H = x.shape
    xo = x if h is None else torch.empty_like(x)
    y = torch.empty_like(x)
    bf16 = int(x.dtype == torch.bfloat16)
    if T * H >= 1 << 16:  # a prefill's rows: blocks of 64 rows over torch's threads
        _get().add_rms_norm_mt(T, H, _ptr(x), _ptr(h), _ptr(xo), _ptr(w), eps, _ptr(y), bf16, torch.get_num_threads())
    else:
        _get().add_rms_norm(0, T, H, _ptr(x), _ptr(h), _ptr(xo), _ptr(w), eps, _ptr(y), None, bf16)
    return xo, y


def gemv_bf16(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, threads: int = 1) -> torch.Tensor:
    """x [M, K] (any float dtype) @ w [N, K]^T for a contiguous bfloat16 w, float32 arithmetic;
    returns [M, N] in out_dtype (float32 or bfloat16). For a few rows (decode)."""
    M, K = x.shape
    N = w.shape[0]
    xf = x.float().contiguous()
    y = torch.empty(M, N, dtype=out_dtype)
    _get().gemv_bf16(M, N, K, _ptr(xf), _ptr(w), _ptr(y), int(out_dtype == torch.bfloat16), threads)
    return y


def attn_decode(
    qkv, qk_norm, eps, cos, sin, kv_pool, slot_mapping, block_tables, seq_lens, h, kvh, scale, seq_starts=None
):
    """One token per row through a gated attention layer after its qkv projection.

    qkv [B, >= 2*(H+KVH)*hd] rows [q | k | gate | v] (model dtype, unit stride on the last axis),
    qk_norm [H+KVH, hd] float32 (1 + w of q_norm per query head, then of k_norm per KV head),
    cos, sin [B, rd] (or [B, 1, rd]) the rotary tables at the rows' positions, kv_pool the
    kernels' view [num_blocks, 2, KVH, bs, hd] (any strides, unit stride on hd, model dtype),
    slot_mapping / seq_lens [B] int64, block_tables [B, max_blocks] int64. Writes the new k, v
    to their pages and returns attention(q, pages) * sigmoid(gate) [B, H*hd] in the model dtype
    (kernels/attention.py is the reference). Rows are split over `threads(B)` threads.

    seq_starts [S+1] int64 (optional): rows that are consecutive tokens of one sequence (a
    speculative row, an MTP chunk), rows seq_starts[i] .. seq_starts[i+1]-1 each; block_tables,
    seq_lens and slot_mapping stay per row. A sequence's rows run in order on one thread, so
    each attends to the k, v of the rows before it: causal attention within the sequence.
    """
    B, dtype = qkv.shape[0], qkv.dtype
    hd = kv_pool.shape[-1]
    rd = cos.shape[-1]
    assert qkv.stride(1) == 1 and kv_pool.stride(-1) == 1 and kv_pool.dtype == dtype
    assert cos.dtype == dtype and sin.dtype == dtype and qk_norm.dtype == torch.float32
    cos, sin = cos.reshape(B, rd).contiguous(), sin.reshape(B, rd).contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty(B, h * hd, dtype=dtype)
    seq_starts = None if seq_starts is None else seq_starts.to(torch.int64).contiguous()
    nseq = B if seq_starts is None else seq_starts.numel() - 1
    nt = threads(nseq)
    stride = (h + kvh) * hd + h // kvh * (hd + block_tables.shape[1] * kv_pool.shape[3])
    work = torch.empty(nt * stride, dtype=torch.float32)
    s_blk, s_kv, s_head, s_tok, _ = kv_pool.stride()
    _get().attn_decode(
        B, h, kvh, hd, rd, _ptr(qkv), qkv.stride(0), _ptr(qk_norm.contiguous()), eps, _ptr(cos), _ptr(sin),
        _ptr(kv_pool), s_blk, s_kv, s_head, s_tok, kv_pool.shape[3], _ptr(slot_mapping), _ptr(block_tables),
        block_tables.shape[1], _ptr(seq_lens), scale, _ptr(out), _ptr(work), stride, int(dtype == torch.bfloat16), nt,
        _ptr(seq_starts), nseq,
    )  # fmt: skip
    return out


def pack_f32(w: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] packed for `gemm_f32`: [ceil(N/16), K, 16], panels of 16 output
    columns (the last one zero-padded)."""
    N, K = w.shape
    w = w.float().contiguous()
    wp = torch.empty((N + 15) // 16, K, 16, dtype=torch.float32)
    _get().pack_f32(N, K, _ptr(w), _ptr(wp))
    return wp


def gemm_f32(x: torch.Tensor, wp: torch.Tensor, n: int, threads: int = 1) -> torch.Tensor:
    """x [M, K] float32 @ w^T for wp = pack_f32(w [n, K]): y [M, n] float32, output panels split
    over `threads` threads. For a decode step's few rows."""
    M, K = x.shape
    if wp.shape != ((n + 15) // 16, K, 16):
        raise ValueError(f"packed weight {tuple(wp.shape)} does not fit x {tuple(x.shape)} and n={n}")
    x = x.contiguous()
    y = torch.empty(M, n, dtype=torch.float32)
    _get().gemm_f32(M, n, K, _ptr(x), _ptr(wp), _ptr(y), threads)
    return y


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [M, 2I] float32 (unit stride on the last axis) -> silu(gu[:, :I]) * gu[:, I:] [M, I]:
    the MLP's gate in one pass (engine/model/layers.py MLP is the reference), rows split over
    torch's threads when there are many."""
    M, I2 = gu.shape
    if gu.dtype != torch.float32 or gu.stride(1) != 1 or I2 % 2:
        raise ValueError(f"silu_mul takes float32 [M, 2I] with unit stride (got {gu.dtype} {tuple(gu.shape)})")
    out = torch.empty(M, I2 // 2, dtype=torch.float32)
    nt = torch.get_num_threads() if M * I2 >= 1 << 16 else 1
    _get().silu_mul_f32(M, I2 // 2, _ptr(gu), gu.stride(0), _ptr(out), nt)
    return out


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
):
    """A GDN layer after its input projection for rows of any length (decode rows, prefill
    chunks, both), token by token in the recurrent form (`gdn_decode` per token).

    proj [T, D + Hv*dv + 2*Hv] rows [qkv | z | b | a]; row_cu [R+1] int64 token offsets of the
    rows; row_slots [R] int64 (distinct); row_init [R] bool (False: the row starts from zero
    state); tok_slots [T] int64 each token's slot; the rest as `gdn_decode`. Returns [T, Hv*dv]
    and leaves each row's final conv and recurrent state in its slot (kernels/gdn.py's
    gdn_chunk_prefill / causal_conv1d compute the same). Rows are split over threads by tokens.
    """
    T, dtype = proj.shape[0], proj.dtype
    D, kc = conv_w.shape
    R = row_slots.numel()
    assert proj.stride(1) == 1 and conv_pool.is_contiguous() and rec_pool.is_contiguous()
    assert row_init.dtype == torch.bool and row_cu.shape == (R + 1,) and tok_slots.shape == (T,)
    out = torch.empty(T, hv * dv, dtype=dtype)
    nt = threads(R)
    stride = D + 2 * hv + (kc - 1) * D  # per thread: gdn_decode's scratch and a row's saved conv inputs
    work = torch.empty(nt * stride + kc * D, dtype=torch.float32)  # and the conv weight transposed
    _get().gdn_rows_mt(
        R, _ptr(row_cu), _ptr(row_slots), _ptr(row_init), _ptr(tok_slots), hk, hv, dk, dv, kc, _ptr(proj),
        proj.stride(0), _ptr(conv_w), _ptr(conv_pool), _ptr(rec_pool), _ptr(neg_A), _ptr(dt_bias), _ptr(norm_w),
        eps, _ptr(out), _ptr(work), stride, int(dtype == torch.bfloat16), nt,
    )  # fmt: skip
    return out


# ---- Speculative verification (kernels/csrc/cpu_ops.c, last section) --------------------------


def gdn_verify(
    proj, conv_w, conv_pool, rec_pool, slots, cu_seqlens, conv_scratch, rec_scratch, neg_A, dt_bias, norm_w,
    hk, hv, dk, dv, eps,
) -> torch.Tensor:  # fmt: skip
    """Decode rows of 1..n tokens each (a pending token and its drafts) through a GDN layer:
    `gdn_decode` token by token on each row's slot, keeping the state after every token but a
    row's last in its scratch entries, for rollback.

    proj [T, D + Hv*dv + 2*Hv] packed over the rows (cu_seqlens [B+1] int64), slots [B] int64,
    conv_scratch [>= B, n1, D, Kc-1] model dtype and rec_scratch [>= B, n1, Hv, dk, dv] float32
    (entry [b, j]: row b after its token j, for j < len_b - 1; n1 >= the longest row), the rest
    as for `gdn_decode`. Returns the gated-normed output [T, Hv*dv] in the model dtype.
    """
    T, dtype = proj.shape[0], proj.dtype
    D, kc = conv_w.shape
    B = slots.numel()
    n1 = conv_scratch.shape[1]
    assert proj.stride(1) == 1 and conv_pool.is_contiguous() and rec_pool.is_contiguous()
    assert conv_scratch.is_contiguous() and rec_scratch.is_contiguous() and rec_scratch.shape[1] == n1
    assert conv_scratch.shape[0] >= B and rec_scratch.shape[0] >= B and cu_seqlens.shape == (B + 1,)
    assert conv_pool.dtype == conv_scratch.dtype == conv_w.dtype == norm_w.dtype == dtype
    assert rec_pool.dtype == rec_scratch.dtype == torch.float32
    assert slots.dtype == cu_seqlens.dtype == torch.int64 and slots.is_contiguous() and cu_seqlens.is_contiguous()
    out = torch.empty(T, hv * dv, dtype=dtype)
    work = torch.empty(D + 2 * hv, dtype=torch.float32)
    _get().gdn_verify(
        B, _ptr(cu_seqlens), hk, hv, dk, dv, kc, _ptr(proj), proj.stride(0), _ptr(conv_w), _ptr(conv_pool),
        _ptr(rec_pool), _ptr(slots), _ptr(neg_A), _ptr(dt_bias), _ptr(norm_w), eps, _ptr(out), _ptr(work),
        int(dtype == torch.bfloat16), _ptr(conv_scratch), _ptr(rec_scratch), n1,
    )  # fmt: skip
    return out
