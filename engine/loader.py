"""Checkpoint loading: safetensors as transformers writes them (one file or sharded), every
expected tensor's shape checked before any is read, sharded for one tensor-parallel rank and fused
for the model; FP8 block-quantized weights dequantized once (routed experts may stay FP8), the MTP
block read only when it drafts (docs/engine.md, "Module notes")."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.model.linear import Linear
from engine.shard import conv_channel_index, head_range, intermediate_range, kv_head_range
from kernels.fp8 import dequant_fp8_block

FP8Experts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # w13, w13 scales, w2, w2 scales

log = logging.getLogger("pdserve.loader")

IGNORED = {  # what the text model does not use: pattern -> what it is, for the one log line
    "multi-token-prediction head": re.compile(r"^mtp\."),
    "vision tower": re.compile(r"^(model\.)?visual\."),
}
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)
Shapes = dict[str, tuple[int, ...]]


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"checkpoint index names shards that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn}


class _Reader:
    """Tensor names, shapes and dtypes from the safetensors headers; tensors read on demand."""

    def __init__(self, path: Path):
        self.where: dict[str, Path] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, object] = {}
        for f in _checkpoint_files(path):
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    s = h.get_slice(k)
                    self.where[k] = f
                    self.shape[k] = tuple(s.get_shape())
                    self.dtype[k] = _ST_DTYPES.get(s.get_dtype(), s.get_dtype())
        self._handles: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        f = self.where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f].get_tensor(name)


# ---- expected shapes, one function per block ----------------------------------------------


def _gdn_shapes(cfg: ModelConfig, a: str) -> Shapes:
    H, hv, kc = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
    out = {
        a + "conv1d.weight": (cfg.conv_dim, 1, kc),
        a + "A_log": (hv,),
        a + "dt_bias": (hv,),
        a + "norm.weight": (cfg.linear_value_head_dim,),
        a + "out_proj.weight": (H, cfg.value_dim),
    }
    if cfg.fused_gdn_projections:
        out[a + "in_proj_qkvz.weight"] = (cfg.conv_dim + cfg.value_dim, H)
        out[a + "in_proj_ba.weight"] = (2 * hv, H)
    else:
        out.update(
            {
                a + "in_proj_qkv.weight": (cfg.conv_dim, H),
                a + "in_proj_z.weight": (cfg.value_dim, H),
                a + "in_proj_b.weight": (hv, H),
                a + "in_proj_a.weight": (hv, H),
            }
        )
    return out


def _attention_shapes(cfg: ModelConfig, a: str) -> Shapes:
    H, hd, nh, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_kv_heads
    return {
        a + "q_proj.weight": (2 * nh * hd, H),
        a + "k_proj.weight": (kvh * hd, H),
        a + "v_proj.weight": (kvh * hd, H),
        a + "o_proj.weight": (H, nh * hd),
        a + "q_norm.weight": (hd,),
        a + "k_norm.weight": (hd,),
    }


def _mlp_shapes(m: str, hidden: int, inter: int) -> Shapes:
    return {
        m + "gate_proj.weight": (inter, hidden),
        m + "up_proj.weight": (inter, hidden),
        m + "down_proj.weight": (hidden, inter),
    }


def _fused_experts(m: str, names) -> bool:
    """Experts stored as transformers fuses them in memory, rather than one tensor per expert."""
    return m + "experts.gate_up_proj" in names


def _moe_shapes(cfg: ModelConfig, m: str, names) -> Shapes:
    H, E, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    out = {m + "gate.weight": (E, H), m + "shared_expert_gate.weight": (1, H)}
    out.update(_mlp_shapes(m + "shared_expert.", H, cfg.shared_expert_intermediate_size))
    if _fused_experts(m, names):
        out[m + "experts.gate_up_proj"] = (E, 2 * inter, H)
        out[m + "experts.down_proj"] = (E, H, inter)
    else:
        for e in range(E):
            out.update(_mlp_shapes(f"{m}experts.{e}.", H, inter))
    return out


def expected_weights(cfg: ModelConfig, names=()) -> Shapes:
    """Every tensor the text model needs, with its global shape. `names` (the checkpoint's) picks
    the expert layout of each MoE layer."""
    p, H = cfg.weight_prefix, cfg.hidden_size
    out = {f"{p}embed_tokens.weight": (cfg.vocab_size, H), f"{p}norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, H)
    for i, kind in enumerate(cfg.layer_types):
        lp = f"{p}layers.{i}."
        out[lp + "input_layernorm.weight"] = (H,)
        out[lp + "post_attention_layernorm.weight"] = (H,)
        if kind == "linear_attention":
            out.update(_gdn_shapes(cfg, lp + "linear_attn."))
        else:
            out.update(_attention_shapes(cfg, lp + "self_attn."))
        if cfg.is_moe_layer(i):
            out.update(_moe_shapes(cfg, lp + "mlp.", names))
        else:
            out.update(_mlp_shapes(lp + "mlp.", H, cfg.intermediate_size))
    return out


def _scale_shape(cfg: ModelConfig, shape: tuple[int, ...]) -> tuple[int, ...]:
    bn, bk = cfg.fp8_block_size
    return (*shape[:-2], math.ceil(shape[-2] / bn), math.ceil(shape[-1] / bk))


def check_checkpoint(cfg: ModelConfig, reader: _Reader) -> Shapes:
    """Refuse a checkpoint that cannot be loaded whole, before anything is read; one line each."""
    where = cfg.path
    expected = expected_weights(cfg, reader.where)
    missing = [n for n in expected if n not in reader.where]
    if missing:
        shown = ", ".join(f"{n} (expected shape {list(expected[n])})" for n in missing[:4])
        raise ValueError(f"checkpoint {where} lacks {len(missing)} weight(s): {shown}")
    scales = _fp8_scales(cfg, reader, expected)
    known = set(expected) | set(scales) | ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    unexpected, ignored = [], {}
    for n in reader.where:
        if n in known:
            continue
        what = next((w for w, r in IGNORED.items() if r.match(n)), None)
        if what is None:
            unexpected.append(n)
        else:
            ignored[what] = ignored.get(what, 0) + 1
    if unexpected:
        raise ValueError(f"checkpoint {where} has {len(unexpected)} unexpected weight(s): {', '.join(unexpected[:8])}")
    _check_shapes(cfg, reader, expected, scales)
    for what, count in ignored.items():
        log.info("main model: leaving out %d weight(s) of the %s in %s", count, what, where)
    return scales


def _fp8_scales(cfg: ModelConfig, reader: _Reader, expected: Shapes) -> Shapes:
    """The `*_scale_inv` tensors beside expected weights, with their expected shapes."""
    if cfg.fp8_block_size is None:
        return {}
    return {n + SCALE_SUFFIX: _scale_shape(cfg, s) for n, s in expected.items() if n + SCALE_SUFFIX in reader.where}


def _check_shapes(cfg: ModelConfig, reader: _Reader, expected: Shapes, scales: Shapes) -> None:
    for n, want in {**expected, **scales}.items():
        if reader.shape[n] != want:
            raise ValueError(f"checkpoint {cfg.path}: {n} has shape {list(reader.shape[n])}, expected {list(want)}")
    for n in expected:
        if reader.dtype[n] in FP8_DTYPES and n + SCALE_SUFFIX not in scales:
            why = (
                "has no " + n + SCALE_SUFFIX
                if cfg.fp8_block_size
                else "is float8 but config.json has no fp8 quantization_config"
            )
            raise ValueError(f"checkpoint {cfg.path}: {n} {why}")


# ---- loading, one function per block -------------------------------------------------------


class _Weights:
    """Reads a checkpoint tensor in the compute dtype (dequantizing FP8 blocks) and slices it."""

    def __init__(self, cfg: ModelConfig, reader: _Reader, scales: Shapes, device):
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
    elif _fused_experts(m, get.reader.where):
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
    if _fused_experts(m, get.reader.where) or start % bn or n % bn or start % bk or n % bk:
        log.info(
            "%s: FP8 experts dequantized at load: keeping them needs one tensor per expert and a rank's "
            "%d of %d intermediate rows in whole [%d, %d] blocks",
            m.rstrip("."), n, cfg.moe_intermediate_size, bn, bk,
        )  # fmt: skip
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
    reader = _Reader(Path(cfg.path))
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


def expected_mtp_weights(cfg: ModelConfig, names=()) -> Shapes:
    """The multi-token-prediction block as published (docs/ARCHITECTURE.md, speculative decoding):
    two pre-fc norms, `fc` over [embedding | hidden], full-attention decoder layers with the
    model's MLP (the MoE block in an MoE model), a final norm."""
    H = cfg.hidden_size
    out = {
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.fc.weight": (H, 2 * H),
        "mtp.norm.weight": (H,),
    }
    for j in range(cfg.mtp_num_layers):
        lp = f"mtp.layers.{j}."
        out[lp + "input_layernorm.weight"] = (H,)
        out[lp + "post_attention_layernorm.weight"] = (H,)
        out.update(_attention_shapes(cfg, lp + "self_attn."))
        if cfg.num_experts:
            out.update(_moe_shapes(cfg, lp + "mlp.", names))
        else:
            out.update(_mlp_shapes(lp + "mlp.", H, cfg.intermediate_size))
    return out


def load_mtp_weights(cfg: ModelConfig, tp: int, rank: int, device="cpu") -> dict:
    """The `mtp.*` block of `rank` as {"norm_embed", "norm_hidden", "fc", "norm", "layers": [...]}
    (layers as in `load_weights`, full attention); embedding and LM head are the main model's."""
    reader = _Reader(Path(cfg.path))
    expected = expected_mtp_weights(cfg, reader.where)
    missing = [n for n in expected if n not in reader.where]
    if missing:
        raise ValueError(
            f"speculative_method='mtp' needs the checkpoint's mtp.* weights; {cfg.path} lacks {len(missing)}: "
            f"{', '.join(missing[:6])}"
        )
    scales = _fp8_scales(cfg, reader, expected)
    _check_shapes(cfg, reader, expected, scales)
    get = _Weights(cfg, reader, scales, device)
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
