"""The vision tower's weights (`model.visual.*`) read from a vision-language checkpoint, shapes
checked against the config in one line before use; replicated on every rank."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.checkpoint import Reader
from engine.vision.config import VisionConfig

PREFIX = "model.visual."


def expected_vision_weights(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    d, i, o = cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size
    m = d * cfg.spatial_merge_size**2
    p, t = cfg.patch_size, cfg.temporal_patch_size
    out: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (d, cfg.in_channels, t, p, p),
        "patch_embed.proj.bias": (d,),
        "pos_embed.weight": (cfg.num_position_embeddings, d),
        "merger.norm.weight": (d,),
        "merger.norm.bias": (d,),
        "merger.linear_fc1.weight": (m, m),
        "merger.linear_fc1.bias": (m,),
        "merger.linear_fc2.weight": (o, m),
        "merger.linear_fc2.bias": (o,),
    }
    for b in range(cfg.depth):
        for name, shape in (
            ("norm1", (d,)),
            ("norm2", (d,)),
            ("attn.qkv", (3 * d, d)),
            ("attn.proj", (d, d)),
            ("mlp.linear_fc1", (i, d)),
            ("mlp.linear_fc2", (d, i)),
        ):
            out[f"blocks.{b}.{name}.weight"] = shape
            out[f"blocks.{b}.{name}.bias"] = (shape[0],)
    return out


def load_vision_weights(path: str, cfg: VisionConfig, dtype: torch.dtype, device="cpu") -> dict[str, torch.Tensor]:
    reader = Reader(Path(path))
    expected = expected_vision_weights(cfg)
    missing = [n for n in expected if PREFIX + n not in reader.where]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} vision weight(s): {', '.join(missing[:4])}")
    bad = [
        f"{n} {list(reader.shape[PREFIX + n])} (expected {list(s)})"
        for n, s in expected.items()
        if reader.shape[PREFIX + n] != s
    ]
    if bad:
        raise ValueError(f"checkpoint {path} has vision weights of the wrong shape: {'; '.join(bad[:4])}")
    if any((PREFIX + n + "_scale_inv") in reader.where for n in expected):
        raise ValueError(f"checkpoint {path}: an FP8-quantized vision tower is not supported")
    return {n: reader.get(PREFIX + n).to(device=device, dtype=dtype).contiguous() for n in expected}
