"""Checkpoint loading: safetensors as transformers writes them (one file or sharded), every
expected tensor's shape checked before any is read, sharded for one tensor-parallel rank and fused
for the model; FP8 block-quantized weights dequantized once, or kept FP8 (routed experts by
`fp8_experts`, dense projections by `fp8_dense`, TP slices with their block scales), the MTP block
read only when it drafts (docs/engine.md, "Module notes")."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch

from engine.checkpoint import SCALE_SUFFIX, Reader, Shapes, check_checkpoint, check_mtp_checkpoint, fused_experts
from engine.config import ModelConfig
from engine.config_fields import keeps_fp8
from engine.model.linear import Linear
from engine.shard import conv_channel_index, head_range, intermediate_range, kv_head_range
from kernels.fp8 import cat_fp8_block, dequant_fp8_block, narrow_fp8_block

FP8Experts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # w13, w13 scales, w2, w2 scales

log = logging.getLogger("pdserve.loader")


# ---- loading, one function per block -------------------------------------------------------


class FP8Part(NamedTuple):
    """A slice of a block-quantized projection kept in FP8: float8 rows, their scales, the block."""

    w: torch.Tensor
    scale_inv: torch.Tensor
    block_size: tuple[int, int]


def _runs(idx: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive indices in idx, in order."""
    idx = idx.flatten()
    cuts = (torch.nonzero(idx[1:] - idx[:-1] != 1).flatten() + 1).tolist()
    bounds = [0, *cuts, idx.numel()]
    return [(int(idx[a]), b - a) for a, b in zip(bounds, bounds[1:])]


class _Weights:
    """Reads a checkpoint tensor in the compute dtype (dequantizing FP8 blocks) and slices it; with
    dense FP8 kept, a quantized projection's slices stay FP8 (`part`, `linear`)."""

    def __init__(self, cfg: ModelConfig, reader: Reader, scales: Shapes, device):
        self.cfg, self.reader, self.scales, self.device = cfg, reader, scales, device
        self.keep_fp8 = cfg.fp8_block_size is not None and keeps_fp8(cfg.fp8_dense, torch.device(device).type == "cuda")

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

    def part(self, name: str, rows=None, cols=None) -> torch.Tensor | FP8Part:
        """As `__call__`, but a quantized projection stays FP8 when dense FP8 is kept: each run of
        consecutive rows (columns) narrowed with its scales, the runs concatenated (kernels.fp8)."""
        if not (self.keep_fp8 and name + SCALE_SUFFIX in self.scales):
            return self(name, rows, cols)
        assert self.cfg.fp8_block_size is not None
        w, s, block = self.reader.get(name), self.reader.get(name + SCALE_SUFFIX).float(), self.cfg.fp8_block_size
        for dim, idx in ((0, rows), (1, cols)):
            if idx is not None:
                parts = [narrow_fp8_block(w, s, block, dim, a, n) for a, n in _runs(torch.as_tensor(idx))]
                w, s, block = cat_fp8_block(parts, dim) if len(parts) > 1 else parts[0]
        return FP8Part(w.to(self.device), s.to(self.device), block)

    def linear(self, *parts: torch.Tensor | FP8Part) -> Linear:
        """One Linear over `parts` stacked by rows: FP8 when the leading parts are (rows the
        checkpoint left unquantized, such as GDN's b and a, follow as its tail), else in the compute
        dtype."""
        n = next((i for i, p in enumerate(parts) if not isinstance(p, FP8Part)), len(parts))
        head = [p for p in parts[:n] if isinstance(p, FP8Part)]
        if not head or any(isinstance(p, FP8Part) for p in parts[n:]):
            return Linear(torch.cat([self._plain(p) for p in parts]) if len(parts) > 1 else self._plain(parts[0]))
        w, s, block = cat_fp8_block(head, 0) if len(head) > 1 else head[0]
        tail = [self._plain(p) for p in parts[n:]]
        return Linear.fp8(w, s, block, self.cfg.dtype, torch.cat(tail) if tail else None)

    def _plain(self, p: torch.Tensor | FP8Part) -> torch.Tensor:
        return dequant_fp8_block(*p, self.cfg.dtype) if isinstance(p, FP8Part) else p


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
        w_in = get.linear(
            get.part(a + "in_proj_qkvz.weight", torch.cat([qkv[conv_idx], z[v_rows]])),
            get.part(a + "in_proj_ba.weight", torch.cat([b[vh_idx], a_[vh_idx]])),
        )
    else:
        w_in = get.linear(
            get.part(a + "in_proj_qkv.weight", conv_idx),
            get.part(a + "in_proj_z.weight", v_rows),
            get.part(a + "in_proj_b.weight", vh_idx),
            get.part(a + "in_proj_a.weight", vh_idx),
        )
    return {
        "w_in": w_in,
        "conv": get(a + "conv1d.weight", conv_idx)[:, 0, :].contiguous(),
        "A_log": get(a + "A_log", vh_idx).float(),
        "dt_bias": get(a + "dt_bias", vh_idx),
        "norm": get(a + "norm.weight"),
        "w_out": get.linear(get.part(a + "out_proj.weight", cols=v_rows)),
    }


def _load_attention(cfg: ModelConfig, get: _Weights, a: str, tp: int, rank: int) -> dict:
    hd = cfg.head_dim
    qh = head_range(cfg.num_attention_heads, tp, rank)
    kvh = kv_head_range(cfg.num_kv_heads, tp, rank)
    # q_proj rows are [q | gate] per head: this rank's q rows, its gate rows are hd further
    q_idx = (torch.arange(qh.start, qh.stop)[:, None] * 2 * hd + torch.arange(hd)).flatten()
    q_cols = torch.arange(qh.start * hd, qh.stop * hd)
    kv_rows = torch.arange(kvh.start * hd, kvh.stop * hd)
    return {
        "w_qkv": get.linear(
            get.part(a + "q_proj.weight", q_idx),
            get.part(a + "k_proj.weight", kv_rows),
            get.part(a + "q_proj.weight", q_idx + hd),
            get.part(a + "v_proj.weight", kv_rows),
        ),
        "q_norm": get(a + "q_norm.weight"),
        "k_norm": get(a + "k_norm.weight"),
        "w_o": get.linear(get.part(a + "o_proj.weight", cols=q_cols)),
    }


def _load_mlp(get: _Weights, m: str, rows: torch.Tensor) -> dict:
    """A SwiGLU MLP's column-parallel [gate_r | up_r] and row-parallel down_r."""
    return {
        "w_gate_up": get.linear(get.part(m + "gate_proj.weight", rows), get.part(m + "up_proj.weight", rows)),
        "w_down": get.linear(get.part(m + "down_proj.weight", cols=rows)),
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
        "router": get.linear(get.part(m + "gate.weight")),
        "w13": w13.to(dtype=w13.dtype if fp8 else cfg.dtype, device=get.device).contiguous(),
        "w2": w2.to(dtype=w2.dtype if fp8 else cfg.dtype, device=get.device).contiguous(),
        **scales,
        "shared": _load_mlp(get, m + "shared_expert.", _rank_range(cfg.shared_expert_intermediate_size, tp, rank)),
        "shared_gate": get.linear(get.part(m + "shared_expert_gate.weight")),
    }


def _fp8_experts(cfg: ModelConfig, get: _Weights, m: str, rows: torch.Tensor) -> FP8Experts | None:
    """The routed experts of one MoE layer kept in FP8 (module docstring), or None: dequantize."""
    if not keeps_fp8(cfg.fp8_experts, torch.device(get.device).type == "cuda"):
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
    if get.keep_fp8:
        log.info(
            "dense projections kept in FP8 (--fp8-dense %s): block-FP8 GEMM, tensor-parallel slices with their scales",
            cfg.fp8_dense,
        )
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
        "fc": get.linear(get.part("mtp.fc.weight")),  # [hidden, 2 * hidden], replicated
        "norm": get("mtp.norm.weight"),
        "layers": [
            _load_layer(cfg, get, f"mtp.layers.{j}.", "full_attention", cfg.num_experts > 0, tp, rank)
            for j in range(cfg.mtp_num_layers)
        ],
    }
