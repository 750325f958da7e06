"""What a checkpoint must hold: the tensors each block of the model needs with their shapes, the
FP8 block scales beside them, and the checks that refuse a bad checkpoint in one line before any
tensor is read (engine/loader.py then reads and shards them)."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.config import ModelConfig

log = logging.getLogger("pdserve.loader")

IGNORED = {  # what the text model does not use: pattern -> what it is, for the one log line
    "multi-token-prediction head": re.compile(r"^mtp\."),
    "vision tower": re.compile(r"^(model\.)?visual\."),
}
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
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


class Reader:
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
        self._handles: dict[Path, Any] = {}  # safetensors handles (untyped)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored; a `*_scale_inv` in float32 whatever its stored float dtype (the FP8
        releases store bfloat16 scales; bfloat16 and float16 widen to float32 exactly)."""
        f = self.where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        t = self._handles[f].get_tensor(name)
        return t.float() if name.endswith(SCALE_SUFFIX) else t


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


def fused_experts(m: str, names) -> bool:
    """Experts stored as transformers fuses them in memory, rather than one tensor per expert."""
    return m + "experts.gate_up_proj" in names


def _moe_shapes(cfg: ModelConfig, m: str, names) -> Shapes:
    H, E, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    out: Shapes = {m + "gate.weight": (E, H), m + "shared_expert_gate.weight": (1, H)}
    out.update(_mlp_shapes(m + "shared_expert.", H, cfg.shared_expert_intermediate_size))
    if fused_experts(m, names):
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
    out: Shapes = {f"{p}embed_tokens.weight": (cfg.vocab_size, H), f"{p}norm.weight": (H,)}
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
    assert cfg.fp8_block_size is not None  # only FP8 checkpoints have scales
    bn, bk = cfg.fp8_block_size
    return (*shape[:-2], math.ceil(shape[-2] / bn), math.ceil(shape[-1] / bk))


def check_checkpoint(cfg: ModelConfig, reader: Reader) -> Shapes:
    """Refuse a checkpoint that cannot be loaded whole, before anything is read; one line each."""
    where = cfg.path
    expected = expected_weights(cfg, reader.where)
    missing = [n for n in expected if n not in reader.where]
    if missing:
        shown = ", ".join(f"{n} (expected shape {list(expected[n])})" for n in missing[:4])
        raise ValueError(f"checkpoint {where} lacks {len(missing)} weight(s): {shown}")
    scales = _fp8_scales(cfg, reader, expected)
    known = set(expected) | set(scales) | ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    unexpected: list[str] = []
    ignored: dict[str, int] = {}
    for n in reader.where:
        if n in known:
            continue
        what = next((w for w, r in IGNORED.items() if r.match(n)), None)
        if what == "vision tower" and cfg.vision is not None:
            continue  # read by engine/vision/weights.py
        if what is None:
            unexpected.append(n)
        else:
            ignored[what] = ignored.get(what, 0) + 1
    if unexpected:
        raise ValueError(f"checkpoint {where} has {len(unexpected)} unexpected weight(s): {', '.join(unexpected[:8])}")
    _check_shapes(cfg, reader, expected, scales)
    _check_unconverted(cfg, reader)
    for what, count in ignored.items():
        log.info("main model: leaving out %d weight(s) of the %s in %s", count, what, where)
    return scales


def _unconverted(cfg: ModelConfig) -> tuple[str, list[str]]:
    """The modules config.json's quantization_config leaves unquantized, under the key it uses."""
    raw = json.loads((Path(cfg.path) / "config.json").read_text())
    for qc in (raw.get("quantization_config"), (raw.get("text_config") or {}).get("quantization_config")):
        for key in ("modules_to_not_convert", "ignored_layers"):
            if isinstance(qc, dict) and qc.get(key):
                return key, [str(m) for m in qc[key]]
    return "modules_to_not_convert", []


def _check_unconverted(cfg: ModelConfig, reader: Reader) -> None:
    """Refuse a float8 tensor of a module the config lists as left unquantized: the checkpoint
    contradicts itself. An entry names a module by whole dotted parts ("lm_head", "mlp.gate",
    "model.layers.0.linear_attn.in_proj_a"), so "mlp.gate" is not "mlp.gate_proj"."""
    if cfg.fp8_block_size is None:
        return
    key, modules = _unconverted(cfg)
    for n in (n for n in reader.where if reader.dtype[n] in FP8_DTYPES):
        dotted = "." + n.rsplit(".", 1)[0] + "."
        hit = next((m for m in modules if "." + m.strip(".") + "." in dotted), None)
        if hit is not None:
            raise ValueError(f"checkpoint {cfg.path}: {n} is float8 but quantization_config.{key} lists {hit!r}")


def _fp8_scales(cfg: ModelConfig, reader: Reader, expected: Shapes) -> Shapes:
    """The `*_scale_inv` tensors beside expected weights, with their expected shapes."""
    if cfg.fp8_block_size is None:
        return {}
    return {n + SCALE_SUFFIX: _scale_shape(cfg, s) for n, s in expected.items() if n + SCALE_SUFFIX in reader.where}


def _check_shapes(cfg: ModelConfig, reader: Reader, expected: Shapes, scales: Shapes) -> None:
    for n, want in {**expected, **scales}.items():
        if reader.shape[n] != want:
            raise ValueError(f"checkpoint {cfg.path}: {n} has shape {list(reader.shape[n])}, expected {list(want)}")
    for n in scales:
        if reader.dtype[n] not in SCALE_DTYPES:
            raise ValueError(f"checkpoint {cfg.path}: {n} is {reader.dtype[n]}, expected float32, bfloat16 or float16")
    for n in expected:
        if reader.dtype[n] in FP8_DTYPES and n + SCALE_SUFFIX not in scales:
            why = (
                "has no " + n + SCALE_SUFFIX
                if cfg.fp8_block_size
                else "is float8 but config.json has no fp8 quantization_config"
            )
            raise ValueError(f"checkpoint {cfg.path}: {n} {why}")


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


def check_mtp_checkpoint(cfg: ModelConfig, reader: Reader) -> Shapes:
    """Refuse a checkpoint without a whole, well-shaped `mtp.*` block; its FP8 scales otherwise."""
    expected = expected_mtp_weights(cfg, reader.where)
    missing = [n for n in expected if n not in reader.where]
    if missing:
        raise ValueError(
            f"speculative_method='mtp' needs the checkpoint's mtp.* weights; {cfg.path} lacks {len(missing)}: "
            f"{', '.join(missing[:6])}"
        )
    scales = _fp8_scales(cfg, reader, expected)
    _check_shapes(cfg, reader, expected, scales)
    return scales
