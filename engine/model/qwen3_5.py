"""Qwen3.5 hybrid text model on one tensor-parallel rank: embeddings, a stack of GDN and
gated full-attention decoder layers reading and writing the cache pools, final norm, LM head.
Each layer's MLP is dense or the sparse MoE block (Qwen3.5-MoE, Qwen3-Next: engine/model/moe.py);
Qwen3-Next's layers are the same blocks once the loader has mapped its GDN projections.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import rms_norm
from engine.cache.allocator import CachePools
from engine.config import ModelConfig
from engine.model.batch import ForwardBatch
from engine.model.layers import MLP, AllReduce, Attention, AttentionWeights, GatedDeltaNet, GDNWeights, MLPWeights
from engine.model.moe import MoEWeights, SparseMoE
from engine.model.rotary import Rotary


@dataclass
class DecoderLayer:
    kind: str
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: GatedDeltaNet | Attention
    mlp: MLP | SparseMoE


class Qwen35Model:
    def __init__(self, cfg: ModelConfig, weights: dict, tp: int, all_reduce: AllReduce, max_positions: int, device):
        self.cfg = cfg
        self.embed = weights["embed"]
        self.final_norm = weights["norm"]
        self.lm_head = weights["lm_head"]
        self.eps = cfg.rms_norm_eps
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, max_positions, cfg.dtype, device)
        kvh = max(1, cfg.num_kv_heads // tp)
        self.layers: list[DecoderLayer] = []
        for i, kind in enumerate(cfg.layer_types):
            lw = weights["layers"][i]
            if kind == "linear_attention":
                mixer = GatedDeltaNet(
                    i,
                    GDNWeights(**lw["mixer"]),
                    cfg.linear_num_key_heads // tp,
                    cfg.linear_num_value_heads // tp,
                    cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim,
                    self.eps,
                    all_reduce,
                )
            else:
                mixer = Attention(
                    AttentionWeights(**lw["mixer"]), cfg.num_attention_heads // tp, kvh, cfg.head_dim, self.eps, all_reduce
                )
            if cfg.is_moe_layer(i):
                mlp = SparseMoE(MoEWeights(**lw["mlp"]), cfg.num_experts_per_tok, cfg.norm_topk_prob, all_reduce)
            else:
                mlp = MLP(MLPWeights(**lw["mlp"]), all_reduce)
            self.layers.append(
                DecoderLayer(kind, 1.0 + lw["input_norm"].float(), 1.0 + lw["post_norm"].float(), mixer, mlp)
            )
        self.final_norm = 1.0 + self.final_norm.float()  # norms store (1 + w), precomputed

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pools: CachePools) -> torch.Tensor:
        """Returns logits [R, vocab] (float32) at batch.logits_indices."""
        x = F.embedding(batch.input_ids, self.embed)
        cos, sin = self.rotary(batch.positions)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, self.eps, zero_centered=False)
            if layer.kind == "linear_attention":
                h = layer.mixer(h, batch, pools)
            else:
                h = layer.mixer(h, batch, pools.kv[i], cos, sin)
            x = x + h
            x = x + layer.mlp(rms_norm(x, layer.post_norm, self.eps, zero_centered=False))
        x = rms_norm(x[batch.logits_indices], self.final_norm, self.eps, zero_centered=False)
        return F.linear(x, self.lm_head).float()
