"""`pdserve make-tiny-model DIR`: a small random checkpoint of any supported architecture, written
with transformers' own classes (engine/tiny_model.py). Its flags are TinyModelSpec's fields: the
tiny model's shape, each with its help below."""

from __future__ import annotations

import argparse
import typing
from dataclasses import fields
from pathlib import Path

HELP = {
    "arch": "architecture: dense Qwen3.5, Qwen3.5-MoE or Qwen3-Next",
    "layers": "decoder layers",
    "hidden": "hidden size",
    "intermediate": "dense MLP intermediate size",
    "heads": "attention heads (full-attention layers)",
    "kv_heads": "key/value heads (full-attention layers)",
    "head_dim": "attention head size",
    "linear_key_heads": "GDN key heads",
    "linear_value_heads": "GDN value heads",
    "linear_key_head_dim": "GDN key head size",
    "linear_value_head_dim": "GDN value head size",
    "conv_kernel": "GDN causal conv1d kernel width",
    "full_attention_interval": "every this many layers one is full attention (the rest GDN)",
    "vocab": "vocabulary size (the tokenizer's too)",
    "max_positions": "max_position_embeddings: the longest context",
    "seed": "seed of the random weights (same seed, same checkpoint)",
    "dtype": "dtype the weights are stored in",
    "init_std": "standard deviation of the random weights",
    "tokenizer": "also write a tokenizer (tokenizer.json, chat template)",
    "experts": "routed experts per MoE layer (qwen3_5_moe, qwen3_next)",
    "top_k": "experts each token is routed to",
    "moe_intermediate": "each routed expert's intermediate size",
    "shared_intermediate": "the shared expert's intermediate size",
    "mlp_only_layers": "qwen3_next: comma-separated layers with a dense MLP instead of experts",
    "decoder_sparse_step": "qwen3_next: layer i is MoE when (i + 1) %% step == 0",
    "norm_topk_prob": "qwen3_next: renormalise the top-k routing weights",
    "fp8": "store the projections block-quantized to float8_e4m3fn (with weight_scale_inv)",
    "fp8_block": "the square FP8 quantization block's side",
    "mtp": "also write a multi-token-prediction block (mtp.*, one layer)",
    "vision": "the vision-language model (qwen3_5, qwen3_5_moe): a vision tower and its image processor",
    "vision_depth": "vision tower blocks",
    "vision_hidden": "vision tower hidden size",
    "vision_heads": "vision tower attention heads",
    "vision_intermediate": "vision tower MLP intermediate size",
    "vision_grid": "side of the vision tower's learned position grid",
    "mrope_section": "t,h,w rotary frequencies of the multimodal rope (summing to rotary_dim / 2)",
    "min_pixels": "the image processor's smallest resize (pixels)",
    "max_pixels": "the image processor's largest resize (pixels)",
}


def add_tiny_args(p: argparse.ArgumentParser) -> None:
    """One flag per TinyModelSpec field, its default shown."""
    from engine.tiny_model import TinyModelSpec

    hints = typing.get_type_hints(TinyModelSpec)
    for f in fields(TinyModelSpec):
        flag = "--" + f.name.replace("_", "-")
        shown = "" if f.default == "" else f" (default {f.default})"
        text = HELP.get(f.name, f.name.replace("_", " ")) + shown
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=HELP.get(f.name))
        elif typing.get_origin(hints[f.name]) is typing.Literal:
            p.add_argument(flag, choices=typing.get_args(hints[f.name]), default=f.default, help=text)
        else:
            typ = {"int": int, "float": float, "str": str}.get(str(f.type), type(f.default))
            p.add_argument(flag, type=typ, default=f.default, help=text)


def cmd_make_tiny_model(args) -> int:
    from engine.tiny_model import TinyModelSpec, make_tiny_model

    spec = TinyModelSpec(**{f.name: getattr(args, f.name) for f in fields(TinyModelSpec)})
    d = Path(args.dir)
    if d.is_dir() and any(d.iterdir()) and not (d / "pdserve_tiny.json").is_file():  # a real checkpoint, maybe
        raise ValueError(f"{d} is not empty and holds no tiny model: give an empty or new directory")
    out = make_tiny_model(args.dir, spec)
    moe = f", {spec.experts} experts top-{spec.top_k}" if spec.arch != "qwen3_5" else ""
    fp8 = f", fp8 blocks {spec.fp8_block}" if spec.fp8 else ""
    vl = f", vision tower depth {spec.vision_depth} + image processor" if spec.vision else ""
    print(
        f"wrote {out} ({spec.arch}, {spec.layers} layers, hidden {spec.hidden}{moe}{fp8}{vl}, vocab {spec.vocab}, "
        f"seed {spec.seed})"
    )
    return 0
