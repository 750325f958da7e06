"""A whole float32 or bfloat16 decode step through the decoder layers in one call:
`torch.classes.pdserve.DecodeLayers` (kernels/csrc/decode_layers.cpp), bit-identical to the
per-op path of engine/model/layers.py. Why: docs/cpu.md, "Module notes"."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_ops

__all__ = ["GDNLayerSpec", "AttnLayerSpec", "DecodeLayers"]


@dataclass(frozen=True)
class GDNLayerSpec:
    """A GDN layer's tensors (the arguments of `cpu_ops.gdn_decode`) and its MLP."""

    in_norm: torch.Tensor  # [H] float32 (1 + w)
    post_norm: torch.Tensor
    w_in: torch.Tensor  # packed (cpu_ops.pack_f32 or pack_bf16) [hidden -> D + Hv*dv + 2*Hv]
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
    """A gated attention layer's tensors (the arguments of `cpu_ops.attn_decode`) and its MLP."""

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


class DecodeLayers:
    """The decoder layers of one model, float32 or bfloat16 (`dtype`) on the CPU, as one call per
    decode step; bfloat16 takes weights packed by `cpu_ops.pack_bf16`, float32 by `pack_f32`."""

    def __init__(
        self, hidden: int, eps: float, layers: list[GDNLayerSpec | AttnLayerSpec], dtype: torch.dtype = torch.float32
    ):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the one-call decode runs float32 or bfloat16, not {dtype}")
        if not cpu_ops.available(dtype):
            raise RuntimeError(f"the CPU operators are not loaded ({cpu_ops.status()})")
        self._c = torch.classes.pdserve.DecodeLayers(hidden, eps, dtype == torch.bfloat16)
        for s in layers:
            common = (s.in_norm, s.post_norm, s.w_in, s.w_out, s.w_gu, s.w_down)
            if isinstance(s, GDNLayerSpec):
                self._c.add_gdn(
                    *common,
                    s.n_gu,
                    s.conv_w,
                    s.conv_pool,
                    s.rec_pool,
                    s.neg_A,
                    s.dt_bias,
                    s.norm_w,
                    s.hk,
                    s.hv,
                    s.dk,
                    s.dv,
                    s.eps,
                )
            else:
                self._c.add_attn(*common, s.n_in, s.n_gu, s.qk_norm, s.kv_pool, s.h, s.kvh, s.scale, s.eps)

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
        """x [B, hidden] in the model's dtype (the embeddings) -> the residual stream after every
        layer, in place. One token per row: gdn_slots / slot_mapping / seq_lens [B] int64,
        block_tables [B, max_blocks] int64, cos / sin [B, rd] (or [B, 1, rd]) in the model's
        dtype; the rows' GDN slots and KV pages are updated as the per-op path updates them."""
        B, rd = x.shape[0], cos.shape[-1]
        cos, sin = cos.reshape(B, rd).contiguous(), sin.reshape(B, rd).contiguous()
        # through torch.ops, which lets go of the GIL while the step runs (the class's own method does not)
        torch.ops.pdserve.decode_layers_run(
            self._c, x, gdn_slots, slot_mapping, block_tables.contiguous(), seq_lens, cos, sin
        )
        return x
