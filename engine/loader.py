"""Checkpoint loading: safetensors files as transformers writes them (one file, or shards with
model.safetensors.index.json), sharded for one tensor-parallel rank and fused for the model.

Every weight the model needs must be present and every tensor in the checkpoint must be used
or knowingly ignored (vision tower, multi-token-prediction block); otherwise the error names them.
The multi-token-prediction block (`mtp.*`) is read by `load_mtp_weights` only when MTP
speculative decoding is on; its decoder layer loads through the same per-block functions.
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


def _attention_names(lp: str) -> list[str]:
    a = lp + "self_attn."
    return [a + f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]


def _mlp_names(lp: str) -> list[str]:
    return [lp + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]


def expected_weight_names(cfg: ModelConfig) -> list[str]:
    p = cfg.weight_prefix
    names = [f"{p}embed_tokens.weight", f"{p}norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i, kind in enumerate(cfg.layer_types):
        lp = f"{p}layers.{i}."
        names += [lp + "input_layernorm.weight", lp + "post_attention_layernorm.weight"]
        names += _mlp_names(lp)
        if kind == "linear_attention":
            a = lp + "linear_attn."
            names += [a + n for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                      "in_proj_a.weight", "conv1d.weight", "A_log", "dt_bias",
                                      "norm.weight", "out_proj.weight")]
        else:
            names += _attention_names(lp)
    return names


def expected_mtp_weight_names(cfg: ModelConfig) -> list[str]:
    """The multi-token-prediction block as published (docs/ARCHITECTURE.md, speculative decoding):
    two pre-fc norms, `fc` over [embedding | hidden], full-attention decoder layers, a final norm."""
    names = [f"mtp.{n}.weight" for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")]
    for j in range(cfg.mtp_num_layers):
        lp = f"mtp.layers.{j}."
        names += [lp + "input_layernorm.weight", lp + "post_attention_layernorm.weight"]
        names += _attention_names(lp) + _mlp_names(lp)
    return names


class _Shard:
    """Index sets of one tensor-parallel rank, and a getter that slices, casts and moves."""

    def __init__(self, cfg: ModelConfig, reader: _Reader, tp: int, rank: int, device):
        self.reader, self.dtype, self.device = reader, cfg.dtype, device
        hd, dv = cfg.head_dim, cfg.linear_value_head_dim
        self.vh = vh = head_range(cfg.linear_num_value_heads, tp, rank)
        self.v_rows = torch.arange(vh.start * dv, vh.stop * dv)
        self.vh_idx = torch.arange(vh.start, vh.stop)
        self.conv_idx = torch.tensor(conv_channel_index(cfg, tp, rank))
        self.qh = qh = head_range(cfg.num_attention_heads, tp, rank)
        kvh = kv_head_range(cfg.num_kv_heads, tp, rank)
        self.q_rows = torch.arange(qh.start * 2 * hd, qh.stop * 2 * hd)  # q_proj rows are [q | gate] per head
        self.q_cols = torch.arange(qh.start * hd, qh.stop * hd)
        self.kv_rows = torch.arange(kvh.start * hd, kvh.stop * hd)
        inter = cfg.intermediate_size // tp
        self.m_rows = torch.arange(rank * inter, (rank + 1) * inter)
        self.head_dim = hd

    def get(self, name, rows=None, cols=None):
        w = self.reader.get(name)
        if rows is not None:
            w = w[rows]
        if cols is not None:
            w = w[:, cols]
        return w.to(dtype=self.dtype, device=self.device).contiguous()


def _load_attention(sh: _Shard, lp: str) -> dict:
    """Gated full attention of the layer at prefix `lp`: one [q | k | gate | v] projection."""
    a = lp + "self_attn."
    get, hd = sh.get, sh.head_dim
    qg = get(a + "q_proj.weight", sh.q_rows).view(len(sh.qh), 2, hd, -1)  # per head [q | gate]
    return {
        "w_qkv": Linear(torch.cat([qg[:, 0].reshape(-1, qg.shape[-1]), get(a + "k_proj.weight", sh.kv_rows),
                                   qg[:, 1].reshape(-1, qg.shape[-1]), get(a + "v_proj.weight", sh.kv_rows)])),
        "q_norm": get(a + "q_norm.weight"),
        "k_norm": get(a + "k_norm.weight"),
        "w_o": Linear(get(a + "o_proj.weight", cols=sh.q_cols)),
    }


def _load_mlp(sh: _Shard, lp: str) -> dict:
    get = sh.get
    return {
        "w_gate_up": Linear(torch.cat([get(lp + "mlp.gate_proj.weight", sh.m_rows), get(lp + "mlp.up_proj.weight", sh.m_rows)])),
        "w_down": Linear(get(lp + "mlp.down_proj.weight", cols=sh.m_rows)),
    }


def _load_gdn(sh: _Shard, lp: str) -> dict:
    a = lp + "linear_attn."
    get = sh.get
    return {
        "w_in": Linear(torch.cat([
            get(a + "in_proj_qkv.weight", sh.conv_idx),
            get(a + "in_proj_z.weight", sh.v_rows),
            get(a + "in_proj_b.weight", sh.vh_idx),
            get(a + "in_proj_a.weight", sh.vh_idx),
        ])),
        "conv": get(a + "conv1d.weight", sh.conv_idx)[:, 0, :].contiguous(),
        "A_log": get(a + "A_log", sh.vh_idx).float(),
        "dt_bias": get(a + "dt_bias", sh.vh_idx),
        "norm": get(a + "norm.weight"),
        "w_out": Linear(get(a + "out_proj.weight", cols=sh.v_rows)),
    }


def _load_layer(sh: _Shard, lp: str, kind: str) -> dict:
    return {
        "input_norm": sh.get(lp + "input_layernorm.weight"),
        "post_norm": sh.get(lp + "post_attention_layernorm.weight"),
        "mlp": _load_mlp(sh, lp),
        "mixer": _load_gdn(sh, lp) if kind == "linear_attention" else _load_attention(sh, lp),
    }


def _check_names(cfg: ModelConfig, reader: _Reader, expected: list[str], known: set[str], ignored) -> None:
    missing = [n for n in expected if n not in reader.where]
    if missing:
        raise ValueError(f"checkpoint {cfg.path} lacks {len(missing)} weight(s): {', '.join(missing[:8])}")
    unexpected = [n for n in reader.where if n not in known and not any(r.match(n) for r in ignored)]
    if unexpected:
        raise ValueError(f"checkpoint {cfg.path} has {len(unexpected)} unexpected weight(s): {', '.join(unexpected[:8])}")


def load_weights(cfg: ModelConfig, tp: int, rank: int, device="cpu") -> dict:
    """Weights of `rank` as {"embed", "norm", "lm_head", "layers": [{"input_norm", "post_norm", "mixer", "mlp"}]}."""
    reader = _Reader(Path(cfg.path))
    expected = expected_weight_names(cfg)
    known = set(expected) | ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    _check_names(cfg, reader, expected, known, IGNORED)
    sh = _Shard(cfg, reader, tp, rank, device)
    p = cfg.weight_prefix
    embed = sh.get(f"{p}embed_tokens.weight")
    return {
        "embed": embed,
        "norm": sh.get(f"{p}norm.weight"),
        "lm_head": embed if cfg.tie_word_embeddings else sh.get("lm_head.weight"),
        "layers": [_load_layer(sh, f"{p}layers.{i}.", kind) for i, kind in enumerate(cfg.layer_types)],
    }


def load_mtp_weights(cfg: ModelConfig, tp: int, rank: int, device="cpu") -> dict:
    """The `mtp.*` block of `rank` as {"norm_embed", "norm_hidden", "fc", "norm", "layers": [...]}
    (layers as in `load_weights`, full attention); embedding and LM head are the main model's."""
    reader = _Reader(Path(cfg.path))
    expected = expected_mtp_weight_names(cfg)
    missing = [n for n in expected if n not in reader.where]
    if missing:
        raise ValueError(
            f"speculative_method='mtp' needs the checkpoint's mtp.* weights; {cfg.path} lacks {len(missing)}: "
            f"{', '.join(missing[:6])}"
        )
    sh = _Shard(cfg, reader, tp, rank, device)
    return {
        "norm_embed": sh.get("mtp.pre_fc_norm_embedding.weight"),
        "norm_hidden": sh.get("mtp.pre_fc_norm_hidden.weight"),
        "fc": Linear(sh.get("mtp.fc.weight")),  # [hidden, 2 * hidden], replicated
        "norm": sh.get("mtp.norm.weight"),
        "layers": [_load_layer(sh, f"mtp.layers.{j}.", "full_attention") for j in range(cfg.mtp_num_layers)],
    }
