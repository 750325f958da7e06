"""Checkpoint loading: safetensors files as transformers writes them (one file, or shards with
model.safetensors.index.json), sharded for one tensor-parallel rank and fused for the model.

Every weight the model needs must be present and every tensor in the checkpoint must be used
or knowingly ignored (vision tower, multi-token-prediction head); otherwise the error names them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.model.linear import Linear
from engine.shard import conv_channel_index, head_range, kv_head_range

IGNORED = (re.compile(r"^mtp\."), re.compile(r"^model\.visual\."), re.compile(r"^visual\."))


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


class _Reader:
    def __init__(self, path: Path):
        self.where: dict[str, Path] = {}
        for f in _checkpoint_files(path):
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    self.where[k] = f
        self.used: set[str] = set()
        self._handles: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        f = self.where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        self.used.add(name)
        return self._handles[f].get_tensor(name)


def expected_weight_names(cfg: ModelConfig) -> list[str]:
    p = cfg.weight_prefix
    names = [f"{p}embed_tokens.weight", f"{p}norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i, kind in enumerate(cfg.layer_types):
        lp = f"{p}layers.{i}."
        names += [lp + "input_layernorm.weight", lp + "post_attention_layernorm.weight"]
        names += [lp + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        if kind == "linear_attention":
            a = lp + "linear_attn."
            names += [a + n for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                      "in_proj_a.weight", "conv1d.weight", "A_log", "dt_bias",
                                      "norm.weight", "out_proj.weight")]
        else:
            a = lp + "self_attn."
            names += [a + f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    return names


def load_weights(cfg: ModelConfig, tp: int, rank: int, device="cpu") -> dict:
    """Weights of `rank` as {"embed", "norm", "lm_head", "layers": [{"input_norm", "post_norm", "mixer", "mlp"}]}."""
    reader = _Reader(Path(cfg.path))
    expected = expected_weight_names(cfg)
    missing = [n for n in expected if n not in reader.where]
    if missing:
        raise ValueError(f"checkpoint {cfg.path} lacks {len(missing)} weight(s): {', '.join(missing[:8])}")
    known = set(expected) | ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    unexpected = [n for n in reader.where if n not in known and not any(r.match(n) for r in IGNORED)]
    if unexpected:
        raise ValueError(f"checkpoint {cfg.path} has {len(unexpected)} unexpected weight(s): {', '.join(unexpected[:8])}")

    dt = cfg.dtype

    def get(name, rows=None, cols=None):
        w = reader.get(name)
        if rows is not None:
            w = w[rows]
        if cols is not None:
            w = w[:, cols]
        return w.to(dtype=dt, device=device).contiguous()

    t = Linear  # a projection's [out, in] weight, in the layout its dtype multiplies fastest

    p = cfg.weight_prefix
    hd, dk, dv = cfg.head_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    vh = head_range(cfg.linear_num_value_heads, tp, rank)
    v_rows = torch.arange(vh.start * dv, vh.stop * dv)
    vh_idx = torch.arange(vh.start, vh.stop)
    conv_idx = torch.tensor(conv_channel_index(cfg, tp, rank))
    qh = head_range(cfg.num_attention_heads, tp, rank)
    kvh = kv_head_range(cfg.num_kv_heads, tp, rank)
    q_rows = torch.arange(qh.start * 2 * hd, qh.stop * 2 * hd)  # q_proj rows are [q | gate] per head
    q_cols = torch.arange(qh.start * hd, qh.stop * hd)
    kv_rows = torch.arange(kvh.start * hd, kvh.stop * hd)
    inter = cfg.intermediate_size // tp
    m_rows = torch.arange(rank * inter, (rank + 1) * inter)

    embed = get(f"{p}embed_tokens.weight")
    out = {
        "embed": embed,
        "norm": get(f"{p}norm.weight"),
        "lm_head": embed if cfg.tie_word_embeddings else get("lm_head.weight"),
        "layers": [],
    }
    for i, kind in enumerate(cfg.layer_types):
        lp = f"{p}layers.{i}."
        layer = {
            "input_norm": get(lp + "input_layernorm.weight"),
            "post_norm": get(lp + "post_attention_layernorm.weight"),
            "mlp": {
                "w_gate_up": t(torch.cat([get(lp + "mlp.gate_proj.weight", m_rows), get(lp + "mlp.up_proj.weight", m_rows)])),
                "w_down": t(get(lp + "mlp.down_proj.weight", cols=m_rows)),
            },
        }
        if kind == "linear_attention":
            a = lp + "linear_attn."
            layer["mixer"] = {
                "w_in": t(torch.cat([
                    get(a + "in_proj_qkv.weight", conv_idx),
                    get(a + "in_proj_z.weight", v_rows),
                    get(a + "in_proj_b.weight", vh_idx),
                    get(a + "in_proj_a.weight", vh_idx),
                ])),
                "conv": get(a + "conv1d.weight", conv_idx)[:, 0, :].contiguous(),
                "A_log": get(a + "A_log", vh_idx).float(),
                "dt_bias": get(a + "dt_bias", vh_idx),
                "norm": get(a + "norm.weight"),
                "w_out": t(get(a + "out_proj.weight", cols=v_rows)),
            }
        else:
            a = lp + "self_attn."
            qg = get(a + "q_proj.weight", q_rows).view(len(qh), 2, hd, -1)  # per head [q | gate]
            layer["mixer"] = {
                "w_qkv": t(torch.cat([qg[:, 0].reshape(-1, qg.shape[-1]), get(a + "k_proj.weight", kv_rows),
                                      qg[:, 1].reshape(-1, qg.shape[-1]), get(a + "v_proj.weight", kv_rows)])),
                "q_norm": get(a + "q_norm.weight"),
                "k_norm": get(a + "k_norm.weight"),
                "w_o": t(get(a + "o_proj.weight", cols=q_cols)),
            }
        out["layers"].append(layer)
    return out
