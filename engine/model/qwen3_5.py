"""Qwen3.5 hybrid text model on one tensor-parallel rank: embeddings, a stack of GDN and
gated full-attention decoder layers reading and writing the cache pools, final norm, LM head.
Each layer's MLP is dense or the sparse MoE block (Qwen3.5-MoE, Qwen3-Next: engine/model/moe.py);
Qwen3-Next's layers are the same blocks once the loader has mapped its GDN projections.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.cache.allocator import CachePools
from engine.config import ModelConfig
from engine.model.batch import ForwardBatch
from engine.model.fused_decode import fused_decode
from engine.model.layers import MLP, AllReduce, Attention, AttentionWeights, GatedDeltaNet, GDNWeights, MLPWeights
from engine.model.linear import Linear, row_invariant
from engine.model.moe import MoEWeights, SparseMoE
from engine.model.rotary import Rotary, mrope_axes, mrope_cos_sin
from kernels import add_rms_norm
from kernels.cpu_decode import DecodeLayers

LOGITS_ROWS = 256  # the most logit rows the CPU keeps a float32 buffer for (`Qwen35Model._float`)


@dataclass
class DecoderLayer:
    kind: str
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: GatedDeltaNet | Attention
    mlp: MLP | SparseMoE


def _row_invariant(ws: dict) -> dict:
    """A layer's weights with every projection row-invariant (nested: the shared expert's)."""
    return {
        k: row_invariant(v) if isinstance(v, Linear) else _row_invariant(v) if isinstance(v, dict) else v
        for k, v in ws.items()
    }


def build_layer(cfg: ModelConfig, i: int, kind: str, lw: dict, tp: int, all_reduce: AllReduce) -> DecoderLayer:
    """Decoder layer `i` (GDN or full attention, with the model's MLP) from its loaded weights;
    the MTP block builds its layer here too."""
    eps = cfg.rms_norm_eps
    if cfg.batch_invariant:
        lw = {**lw, **{k: _row_invariant(lw[k]) for k in ("mixer", "mlp")}}
    if kind == "linear_attention":
        mixer = GatedDeltaNet(
            i,
            GDNWeights(**lw["mixer"]),
            cfg.linear_num_key_heads // tp,
            cfg.linear_num_value_heads // tp,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
            eps,
            all_reduce,
            cfg.batch_invariant,
        )
    else:
        kvh = max(1, cfg.num_kv_heads // tp)
        mixer = Attention(
            AttentionWeights(**lw["mixer"]),
            cfg.num_attention_heads // tp,
            kvh,
            cfg.head_dim,
            eps,
            all_reduce,
            cfg.batch_invariant,
        )
    if "router" in lw["mlp"]:  # the sparse MoE block (cfg.is_moe_layer)
        mlp = SparseMoE(
            MoEWeights(**lw["mlp"]), cfg.num_experts_per_tok, cfg.norm_topk_prob, all_reduce, cfg.batch_invariant
        )
    else:
        mlp = MLP(MLPWeights(**lw["mlp"]), all_reduce)
    return DecoderLayer(kind, 1.0 + lw["input_norm"].float(), 1.0 + lw["post_norm"].float(), mixer, mlp)


def run_layer(
    layer: DecoderLayer, x: torch.Tensor, batch: ForwardBatch, pools: CachePools, kv_pool, cos, sin, eps, rows=None
):
    """x + mixer(norm(x)), then + mlp(norm(.)): one pre-norm decoder layer. rows: only these
    tokens' outputs are wanted (the last layer of a prefill); the mixer still writes every
    token's state, then its output projection and the MLP run on these rows only."""
    _, h = add_rms_norm(x, None, layer.input_norm, eps)
    if layer.kind == "linear_attention":
        h = layer.mixer(h, batch, pools, rows=rows)
    else:
        h = layer.mixer(h, batch, kv_pool, cos, sin, rows=rows)
    if rows is not None:
        x = x[rows]
    x, h = add_rms_norm(x, h, layer.post_norm, eps)
    return x + layer.mlp(h)


class Qwen35Model:
    def __init__(self, cfg: ModelConfig, weights: dict, tp: int, all_reduce: AllReduce, max_positions: int, device):
        self.cfg = cfg
        self._logits: torch.Tensor | None = None  # the CPU's float32 logits buffer (`_float`)
        self.embed = weights["embed"]
        self.lm_head = Linear(weights["lm_head"])  # may share the embedding tensor; its GEMM copy is its own
        if cfg.batch_invariant:
            self.lm_head = row_invariant(self.lm_head)
        self.eps = cfg.rms_norm_eps
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, max_positions, cfg.dtype, device, cfg.rope_scaling)
        section = cfg.vision.mrope_section if cfg.vision is not None else (cfg.rotary_dim // 2, 0, 0)
        self.mrope_axes = mrope_axes(cfg.rotary_dim, section).to(device)
        self.layers: list[DecoderLayer] = [
            build_layer(cfg, i, kind, weights["layers"][i], tp, all_reduce) for i, kind in enumerate(cfg.layer_types)
        ]
        self.final_norm = 1.0 + weights["norm"].float()  # norms store (1 + w), precomputed
        self.tp = tp
        self._fused: tuple[CachePools, DecodeLayers | None] | None = None  # (pools, its C decode layers)

    def _fused_decode(self, batch: ForwardBatch, pools: CachePools, want_hidden: bool) -> DecodeLayers | None:
        """The one-call C decode (engine/model/fused_decode.py) when this step is one it covers."""
        dec = batch.decode
        if batch.prefill is not None or dec is None or dec.max_row_tokens != 1 or want_hidden:
            return None
        if self._fused is None or self._fused[0] is not pools:
            self._fused = (pools, fused_decode(self, pools, self.tp))
        return self._fused[1]

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        pools: CachePools,
        want_hidden: bool = False,
        after_layer: Callable[[int], None] | None = None,
    ):
        """Returns logits [R, vocab] (float32) at batch.logits_indices; with want_hidden, also the
        final-normed hidden state of every token [T, hidden] (what the MTP block drafts from).
        after_layer(i): called once decoder layer i's kernels are queued (its KV pages and GDN
        state of this step written); the step then runs layer by layer, never the fused decode."""
        x = F.embedding(batch.input_ids, self.embed)
        if batch.image_rows is not None:  # image placeholders take the encoder's embeddings
            idx, emb = batch.image_rows
            x[idx] = emb.to(x.dtype)
        if batch.rope_positions is None:
            cos, sin = self.rotary(batch.positions)
        else:
            cos, sin = mrope_cos_sin(self.rotary, batch.rope_positions, self.mrope_axes)
        fused = self._fused_decode(batch, pools, want_hidden) if after_layer is None else None
        # The last layer's output matters only where logits are wanted (a prefill's last tokens):
        # its mixer runs on every token (their KV and GDN state), its output projection and MLP
        # on those rows. MTP drafts from every token's hidden state: not then.
        n_out = batch.logits_indices.numel()
        last = len(self.layers) - 1 if fused is None and not want_hidden and 0 < n_out < x.shape[0] else None
        if fused is not None:  # every layer in one C call: the same ops as the loop below
            dec = batch.decode
            x = fused.run(x, dec.slot_ids, batch.slot_mapping, dec.block_tables, dec.seq_lens, cos, sin)
        else:
            for i, layer in enumerate(self.layers):
                rows = batch.logits_indices if i == last else None
                x = run_layer(layer, x, batch, pools, pools.kv.get(i), cos, sin, self.eps, rows)
                if after_layer is not None:
                    after_layer(i)
        if want_hidden:
            _, h = add_rms_norm(x, None, self.final_norm, self.eps)  # one C call on the CPU
            if not n_out:  # a prompt chunk short of its end: no logits, and no head GEMM over no rows
                return h.new_empty(0, self.lm_head.out_features, dtype=torch.float32), h
            return self._float(self.lm_head(h[batch.logits_indices])), h
        if last is None:
            x = x[batch.logits_indices]
        return self._float(self.lm_head(add_rms_norm(x.contiguous(), None, self.final_norm, self.eps)[1]))

    def _float(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits in float32. On the CPU, up to LOGITS_ROWS rows of them go into one
        buffer kept between steps: a new tensor of 64 x 151,936 floats (39 MB, past glibc's largest
        mmap threshold) faults in every page on each step, 11-56 ms where the copy takes 2 ms
        (docs/benchmarks.md). The caller reads them before the next forward; what it keeps, it copies."""
        if logits.dtype == torch.float32 or logits.device.type != "cpu" or logits.shape[0] > LOGITS_ROWS:
            return logits.float()
        n, v = logits.shape
        buf = self._logits
        if buf is None or buf.shape[0] < n or buf.shape[1] != v:
            buf = self._logits = torch.empty(max(n, 2 * buf.shape[0] if buf is not None else 0), v)
        out = buf[:n]
        out.copy_(logits)
        return out
