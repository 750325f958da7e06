"""Checkpoint loading: safetensors as transformers writes them (one file or sharded), every
expected tensor's shape checked before any is read, sharded for one tensor-parallel rank and fused
for the model; FP8 block-quantized weights dequantized once (routed experts may stay FP8), the MTP
block read only when it drafts (docs/engine.md, "Module notes")."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.checkpoint import SCALE_SUFFIX, Reader, Shapes, check_checkpoint, check_mtp_checkpoint, fused_experts
from engine.config import ModelConfig
from engine.model.linear import Linear
from engine.shard import conv_channel_index, head_range, intermediate_range, kv_head_range
from kernels.fp8 import dequant_fp8_block

FP8Experts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # w13, w13 scales, w2, w2 scales

log = logging.getLogger("pdserve.loader")


# ---- loading, one function per block -------------------------------------------------------


class _Weights:
    """Reads a checkpoint tensor in the compute dtype (dequantizing FP8 blocks) and slices it."""

    def __init__(self, cfg: ModelConfig, reader: Reader, scales: Shapes, device):
        self.cfg, self.reader, self.scales, self.device = cfg, reader, scales, device

    def full(self, name: str) -> torch.Tensor:
        w = self.reader.get(name)
        if name + SCALE_SUFFIX in self.scales:
            return dequant_fp8_block(w, self.reader.get(name + SCALE_SUFFIX), self.cfg.fp8_block_size, self.cfg.dtype)
        return w

    def __call__(self, name: str, rows=None, cols=None) -> torch.Tensor:
        """The tensor, rows (dim 0) and columns (dim 1) indexed when given, contiguous."""
        w = self.full(name)
        if rows is not None:
            w = w[rows]
        if cols is not None:
            w = w[:, cols]
        return w.to(dtype=self.cfg.dtype, device=self.device).contiguous()


def _rank_range(size: int, tp: int, rank: int) -> torch.Tensor:
    r = intermediate_range(size, tp, rank)
    return torch.arange(r.start, r.stop)


def _qwen3_next_gdn_rows(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of Qwen3-Next's in_proj_qkvz / in_proj_ba that hold, in the Qwen3.5 order, the global
    conv channels [q | k | v], z, b and a. Per key head g, in_proj_qkvz stores
    [q_g (dk) | k_g (dk) | v_g (r*dv) | z_g (r*dv)] and in_proj_ba [b_g (r) | a_g (r)], r = Hv/Hk,
    value head h = g*r + j; both layouts feed the same conv segments and recurrent state."""
    hk, hv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    r = hv // hk
    group = 2 * dk + 2 * r * dv
    g_k = torch.arange(hk)[:, None] * group
    q = (g_k + torch.arange(dk)).flatten()
    k = (g_k + dk + torch.arange(dk)).flatten()
    v = (g_k + 2 * dk + torch.arange(r * dv)).flatten()
    z = v + r * dv
    g_ba = torch.arange(hk)[:, None] * 2 * r
    b = (g_ba + torch.arange(r)).flatten()
    return torch.cat([q, k, v]), z, b, b + r


def _load_gdn(cfg: ModelConfig, get: _Weights, a: str, tp: int, rank: int) -> dict:
    dv = cfg.linear_value_head_dim
    vh = head_range(cfg.linear_num_value_heads, tp, rank)
    v_rows = torch.arange(vh.start * dv, vh.stop * dv)
    vh_idx = torch.arange(vh.start, vh.stop)
    conv_idx = torch.tensor(conv_channel_index(cfg, tp, rank))
    if cfg.fused_gdn_projections:
        qkv, z, b, a_ = _qwen3_next_gdn_rows(cfg)
        qkvz, ba = get.full(a + "in_proj_qkvz.weight"), get.full(a + "in_proj_ba.weight")
        w_in = torch.cat([qkvz[qkv[conv_idx]], qkvz[z[v_rows]], ba[b[vh_idx]], ba[a_[vh_idx]]])
        w_in = w_in.to(dtype=cfg.dtype, device=get.device)
    else:
        w_in = torch.cat(
            [
                get(a + "in_proj_qkv.weight", conv_idx),
                get(a + "in_proj_z.weight", v_rows),
                get(a + "in_proj_b.weight", vh_idx),
                get(a + "in_proj_a.weight", vh_idx),
            ]
        )
    return {
        "w_in": Linear(w_in),
        "conv": get(a + "conv1d.weight", conv_idx)[:, 0, :].contiguous(),
        "A_log": get(a + "A_log", vh_idx).float(),
        "dt_bias": get(a + "dt_bias", vh_idx),
        "norm": get(a + "norm.weight"),
        "w_out": Linear(get(a + "out_proj.weight", cols=v_rows)),
    }


def _load_attention(cfg: ModelConfig, get: _Weights, a: str, tp: int, rank: int) -> dict:
    hd = cfg.head_dim
    qh = head_range(cfg.num_attention_heads, tp, rank)
    kvh = kv_head_range(cfg.num_kv_heads, tp, rank)
    q_rows = torch.arange(qh.start * 2 * hd, qh.stop * 2 * hd)  # q_proj rows are [q | gate] per head
    q_cols = torch.arange(qh.start * hd, qh.stop * hd)
    kv_rows = torch.arange(kvh.start * hd, kvh.stop * hd)
    qg = get(a + "q_proj.weight", q_rows).view(len(qh), 2, hd, -1)  # per head [q | gate]
    return {
        "w_qkv": Linear(
            torch.cat(
                [
                    qg[:, 0].reshape(-1, qg.shape[-1]),
                    get(a + "k_proj.weight", kv_rows),
                    qg[:, 1].reshape(-1, qg.shape[-1]),
                    get(a + "v_proj.weight", kv_rows),
                ]
            )
        ),
        "q_norm": get(a + "q_norm.weight"),
        "k_norm": get(a + "k_norm.weight"),
        "w_o": Linear(get(a + "o_proj.weight", cols=q_cols)),
    }


def _load_mlp(get: _Weights, m: str, rows: torch.Tensor) -> dict:
    """A SwiGLU MLP's column-parallel [gate_r | up_r] and row-parallel down_r."""
    return {
        "w_gate_up": Linear(torch.cat([get(m + "gate_proj.weight", rows), get(m + "up_proj.weight", rows)])),
        "w_down": Linear(get(m + "down_proj.weight", cols=rows)),
    }


def _load_moe(cfg: ModelConfig, get: _Weights, m: str, tp: int, rank: int) -> dict:
    """Router and shared-expert gate replicated; every expert's (and the shared expert's)
    intermediate dimension split over ranks as engine/shard.py says."""
    inter = cfg.moe_intermediate_size
    rows = _rank_range(inter, tp, rank)
    fp8 = _fp8_experts(cfg, get, m, rows)
    if fp8 is not None:
        w13, s13, w2, s2 = fp8
    elif fused_experts(m, get.reader.where):
        gate_up = get.full(m + "experts.gate_up_proj")  # [E, 2I, H]
        w13 = gate_up[:, torch.cat([rows, inter + rows])]
        w2 = get.full(m + "experts.down_proj")[:, :, rows]  # [E, H, I_r]
    else:
        e_ = [f"{m}experts.{e}." for e in range(cfg.num_experts)]
        w13 = torch.stack([torch.cat([get(p + "gate_proj.weight", rows), get(p + "up_proj.weight", rows)]) for p in e_])
        w2 = torch.stack([get(p + "down_proj.weight", cols=rows) for p in e_])
    scales = {}
    if fp8 is not None:
        scales = {
            "w13_scale_inv": s13.to(get.device),
            "w2_scale_inv": s2.to(get.device),
            "block_size": cfg.fp8_block_size,
        }
    return {
        "router": Linear(get(m + "gate.weight")),
        "w13": w13.to(dtype=w13.dtype if fp8 else cfg.dtype, device=get.device).contiguous(),
        "w2": w2.to(dtype=w2.dtype if fp8 else cfg.dtype, device=get.device).contiguous(),
        **scales,
        "shared": _load_mlp(get, m + "shared_expert.", _rank_range(cfg.shared_expert_intermediate_size, tp, rank)),
        "shared_gate": Linear(get(m + "shared_expert_gate.weight")),
    }


def _fp8_experts(cfg: ModelConfig, get: _Weights, m: str, rows: torch.Tensor) -> FP8Experts | None:
    """The routed experts of one MoE layer kept in FP8 (module docstring), or None: dequantize."""
    mode = cfg.fp8_experts
    if mode == "dequantize" or (mode == "auto" and torch.device(get.device).type != "cuda"):
        return None
    e0 = f"{m}experts.0."
    if cfg.fp8_block_size is None or e0 + "gate_proj.weight" + SCALE_SUFFIX not in get.scales:
        return None  # not an FP8 checkpoint, or its experts are not quantized
    bn, bk = cfg.fp8_block_size
    start, n = int(rows[0]), rows.numel()
    if fused_experts(m, get.reader.where) or start % bn or n % bn or start % bk or n % bk:
        log.info(
            "%s: FP8 experts dequantized at load: keeping them needs one tensor per expert and a rank's "
            "%d of %d intermediate rows in whole [%d, %d] blocks",
            m.rstrip("."),
            n,
            cfg.moe_intermediate_size,
            bn,
            bk,
        )
        return None
    r = slice(start, start + n)
    w13, s13, w2, s2 = [], [], [], []
    for e in range(cfg.num_experts):
        p = f"{m}experts.{e}."
        gate, up, down = (get.reader.get(p + f + "_proj.weight") for f in ("gate", "up", "down"))
        g_s, u_s, d_s = (get.reader.get(p + f + "_proj.weight" + SCALE_SUFFIX) for f in ("gate", "up", "down"))
        w13.append(torch.cat([gate[r], up[r]]))
        s13.append(torch.cat([g_s[start // bn : (start + n) // bn], u_s[start // bn : (start + n) // bn]]))
        w2.append(down[:, r])
        s2.append(d_s[:, start // bk : (start + n) // bk])
    return torch.stack(w13), torch.stack(s13).float(), torch.stack(w2), torch.stack(s2).float()


def _load_layer(cfg: ModelConfig, get: _Weights, lp: str, kind: str, moe: bool, tp: int, rank: int) -> dict:
    if kind == "linear_attention":
        mixer = _load_gdn(cfg, get, lp + "linear_attn.", tp, rank)
    else:
        mixer = _load_attention(cfg, get, lp + "self_attn.", tp, rank)
    if moe:
        mlp = _load_moe(cfg, get, lp + "mlp.", tp, rank)
    else:
        mlp = _load_mlp(get, lp + "mlp.", _rank_range(cfg.intermediate_size, tp, rank))
    return {
        "input_norm": get(lp + "input_layernorm.weight"),
        "post_norm": get(lp + "post_attention_layernorm.weight"),
        "mixer": mixer,
        "mlp": mlp,
    }


def load_weights(cfg: ModelConfig, tp: int, rank: int, device="cpu") -> dict:
    """Weights of `rank` as {"embed", "norm", "lm_head", "layers": [{"input_norm", "post_norm", "mixer", "mlp"}]};
    a MoE layer's "mlp" has "router", "w13", "w2", "shared", "shared_gate"."""
    reader = Reader(Path(cfg.path))
    get = _Weights(cfg, reader, check_checkpoint(cfg, reader), device)
    p = cfg.weight_prefix
    embed = get(f"{p}embed_tokens.weight")
    return {
        "embed": embed,
        "norm": get(f"{p}norm.weight"),
        "lm_head": embed if cfg.tie_word_embeddings else get("lm_head.weight"),
        "layers": [
            _load_layer(cfg, get, f"{p}layers.{i}.", kind, cfg.is_moe_layer(i), tp, rank)
            for i, kind in enumerate(cfg.layer_types)
        ],
    }


def load_mtp_weights(cfg: ModelConfig, tp: int, rank: int, device="cpu") -> dict:
    """The `mtp.*` block of `rank` as {"norm_embed", "norm_hidden", "fc", "norm", "layers": [...]}
    (layers as in `load_weights`, full attention); embedding and LM head are the main model's."""
    reader = Reader(Path(cfg.path))
    get = _Weights(cfg, reader, check_mtp_checkpoint(cfg, reader), device)
    return {
        "norm_embed": get("mtp.pre_fc_norm_embedding.weight"),
        "norm_hidden": get("mtp.pre_fc_norm_hidden.weight"),
        "fc": Linear(get("mtp.fc.weight")),  # [hidden, 2 * hidden], replicated
        "norm": get("mtp.norm.weight"),
        "layers": [
            _load_layer(cfg, get, f"mtp.layers.{j}.", "full_attention", cfg.num_experts > 0, tp, rank)
            for j in range(cfg.mtp_num_layers)
        ],
    }
