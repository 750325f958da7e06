"""A whole float32 decode step through the decoder layers in one C call (`decode_layers_f32`,
last section of csrc/cpu_ops.c).

A decode step at a few rows is a few dozen C ops per layer call; their Python (tensor
allocation, pointer marshalling, the layer objects) costs about as much as the attention and
GDN arithmetic. `DecodeLayers` holds each layer's weight and pool pointers (fixed for a model)
in a C array built once; `DecodeLayers.run` fills the step's pointers and makes one call, which
runs the same C ops in the same order and thread splits as the per-op path
(engine/model/layers.py, the reference), so it returns the same bits.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels import cpu_ops

__all__ = ["GDNLayerSpec", "AttnLayerSpec", "DecodeLayers"]

_i64, _p, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn", _i64),
        *[(n, _p) for n in ("in_norm", "post_norm", "w_in", "w_out", "w_gu", "w_down")],
        *[(n, _i64) for n in ("n_in", "k_out", "n_gu")],
        ("eps", _f32),
        *[(n, _i64) for n in ("hk", "hv", "dk", "dv", "kc")],
        *[(n, _p) for n in ("conv_w", "neg_A", "dt_bias", "norm_w", "conv_pool", "rec_pool")],
        *[(n, _i64) for n in ("h", "kvh", "hd", "s_blk", "s_kv", "s_head", "s_tok", "bs")],
        ("qk_norm", _p),
        ("kv", _p),
        ("scale", _f32),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        *[(n, _i64) for n in ("B", "H", "rd", "nthreads", "bt_width", "work_stride")],
        ("eps", _f32),
        ("x", _p),
        *[(n, _p) for n in ("gdn_slots", "slot_mapping", "block_tables", "seq_lens", "cos", "sin")],
        *[(n, _p) for n in ("h", "proj", "mix", "gu", "act", "o", "work")],
    ]


@dataclass(frozen=True)
class GDNLayerSpec:
    """A GDN layer's float32 tensors (the arguments of `cpu_ops.gdn_decode`) and its MLP."""

    in_norm: torch.Tensor  # [H] float32 (1 + w)
    post_norm: torch.Tensor
    w_in: torch.Tensor  # packed (cpu_ops.pack_f32) [hidden -> D + Hv*dv + 2*Hv]
    w_out: torch.Tensor  # packed [Hv*dv -> hidden]
    w_gu: torch.Tensor  # packed [hidden -> 2I]
    w_down: torch.Tensor  # packed [I -> hidden]
    conv_w: torch.Tensor
    conv_pool: torch.Tensor
    rec_pool: torch.Tensor
    neg_A: torch.Tensor
    dt_bias: torch.Tensor
    norm_w: torch.Tensor
    hk: int
    hv: int
    dk: int
    dv: int
    eps: float
    n_in: int
    n_gu: int


@dataclass(frozen=True)
class AttnLayerSpec:
    """A gated attention layer's float32 tensors (the arguments of `cpu_ops.attn_decode`) and its MLP."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    w_in: torch.Tensor  # packed qkv [hidden -> rows q | k | gate | v]
    w_out: torch.Tensor  # packed o [H*hd -> hidden]
    w_gu: torch.Tensor
    w_down: torch.Tensor
    qk_norm: torch.Tensor  # [H+KVH, hd] float32
    kv_pool: torch.Tensor  # the kernels' view [num_blocks, 2, KVH, bs, hd]
    h: int
    kvh: int
    scale: float
    eps: float
    n_in: int
    n_gu: int


def _check(t: torch.Tensor, what: str) -> int:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous float32 CPU tensor (got {t.dtype} {t.device})")
    return t.data_ptr()


class DecodeLayers:
    """The decoder layers of one model, float32 on the CPU, as one C call per decode step."""

    def __init__(self, hidden: int, eps: float, layers: list[GDNLayerSpec | AttnLayerSpec]):
        lib = cpu_ops._get()
        if lib is None:
            raise RuntimeError("the C ops are not available")
        fn = lib.decode_layers_f32
        fn.argtypes, fn.restype = [_i64, ctypes.POINTER(_Layer), ctypes.POINTER(_Step)], None
        self._fn = fn
        self.hidden, self.eps = hidden, eps
        self._keep = layers  # the tensors the C array points into
        self._arr = (_Layer * len(layers))()
        self._max_in = max(s.n_in for s in layers)
        self._max_gu = max(s.n_gu for s in layers)
        self._max_out = 0
        self._gdn_work = 0
        self._attn = []  # (h, kvh, hd, bs) per attention layer: its scratch depends on the step's pages
        for c, s in zip(self._arr, layers):
            c.in_norm, c.post_norm = _check(s.in_norm, "in_norm"), _check(s.post_norm, "post_norm")
            c.w_in, c.w_out, c.w_gu, c.w_down = (
                _check(w, "packed weight") for w in (s.w_in, s.w_out, s.w_gu, s.w_down)
            )
            c.n_in, c.n_gu, c.k_out, c.eps = s.n_in, s.n_gu, s.w_out.shape[1], s.eps
            self._max_out = max(self._max_out, c.k_out)
            if isinstance(s, GDNLayerSpec):
                c.attn = 0
                c.hk, c.hv, c.dk, c.dv, c.kc = s.hk, s.hv, s.dk, s.dv, s.conv_w.shape[1]
                c.conv_w, c.conv_pool, c.rec_pool = (
                    _check(t, n)
                    for t, n in ((s.conv_w, "conv_w"), (s.conv_pool, "conv_pool"), (s.rec_pool, "rec_pool"))
                )
                c.neg_A, c.dt_bias, c.norm_w = (_check(t, "GDN constant") for t in (s.neg_A, s.dt_bias, s.norm_w))
                self._gdn_work = max(self._gdn_work, s.conv_w.shape[0] + 2 * s.hv)
            else:
                kv = s.kv_pool
                if kv.dtype != torch.float32 or kv.stride(-1) != 1:
                    raise ValueError("kv_pool must be float32 with unit stride on hd")
                c.attn = 1
                c.h, c.kvh, c.hd, c.bs = s.h, s.kvh, kv.shape[-1], kv.shape[3]
                c.s_blk, c.s_kv, c.s_head, c.s_tok, _ = kv.stride()
                c.qk_norm, c.kv, c.scale = _check(s.qk_norm, "qk_norm"), kv.data_ptr(), s.scale
                self._attn.append((s.h, s.kvh, kv.shape[-1], kv.shape[3]))

    def run(
        self,
        x: torch.Tensor,
        gdn_slots: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, hidden] float32 (the embeddings) -> the residual stream after every layer, in
        place. One token per row: gdn_slots / slot_mapping / seq_lens [B] int64, block_tables
        [B, max_blocks] int64, cos / sin [B, rd] float32 (as `cpu_ops.attn_decode` takes them);
        the rows' GDN slots and KV pages are updated as the per-op path updates them."""
        B, H = x.shape
        nt = torch.get_num_threads()
        rd = cos.shape[-1]
        cos, sin = cos.reshape(B, rd).contiguous(), sin.reshape(B, rd).contiguous()
        block_tables = block_tables.contiguous()
        width = block_tables.shape[1]
        stride = max(
            [self._gdn_work, H] + [(h + kvh) * hd + h // kvh * (hd + width * bs) for h, kvh, hd, bs in self._attn]
        )
        rows_nt = max(1, min(nt, B, 8))
        buf = torch.empty(
            B * (2 * H + self._max_in + self._max_out + self._max_gu + self._max_gu // 2), dtype=torch.float32
        )
        work = torch.empty(max(rows_nt, 1) * stride, dtype=torch.float32)
        base, f = buf.data_ptr(), 4
        s = _Step(B, H, rd, nt, width, stride, self.eps, _check(x, "x"))
        s.gdn_slots, s.slot_mapping, s.block_tables, s.seq_lens = (
            t.data_ptr() for t in (gdn_slots, slot_mapping, block_tables, seq_lens)
        )
        s.cos, s.sin = _check(cos, "cos"), _check(sin, "sin")
        off = 0
        for name, n in (("h", H), ("o", H), ("proj", self._max_in), ("mix", self._max_out), ("gu", self._max_gu)):
            setattr(s, name, base + off * f)
            off += B * n
        s.act = base + off * f
        s.work = work.data_ptr()
        self._fn(len(self._arr), self._arr, ctypes.byref(s))
        return x
