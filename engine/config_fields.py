"""The parts of a checkpoint's config.json that config.py's ModelConfig reads through a rule of
their own: the architectures, the MoE sizes of each architecture, the FP8 quantization block,
the end-of-sequence ids, whether images are served; and the context a server runs with against the
checkpoint's (`max_model_len`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import ModelConfig

SUPPORTED_QUANTIZATION = ("fp8",)
DTYPE_ALIASES = {"half": "float16", "bf16": "bfloat16", "float": "float32"}  # vLLM's names -> torch's


def keeps_fp8(mode: str, cuda: bool) -> bool:
    """Whether --fp8-experts / --fp8-dense `mode` keeps an FP8 checkpoint's weights in FP8 on a
    device (`cuda`: a GPU): "keep", or "auto" on CUDA; "dequantize" never."""
    return mode == "keep" or (mode == "auto" and cuda)


# set to 1 (or true): a max_model_len past the checkpoint's positions is taken (vLLM's name, as recipes set it)
ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
# architecture -> the text model's model_type (a wrapper's text_config holds the text model)
ARCHITECTURES = {
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_text",
    "Qwen3NextForCausalLM": "qwen3_next",
}
WRAPPERS = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")  # text under text_config


def architecture(raw: dict, where: Path) -> str:
    """The first of the config's `architectures` that pdserve serves (ValueError naming them)."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or raw.get('model_type')!r} in {where}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


def eos_token_ids(path, raw: dict, text: dict) -> tuple[int, ...]:
    """The text model's eos_token_id, the config's, else generation_config.json's: one or several."""
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    gen_cfg = Path(path) / "generation_config.json"
    if eos is None and gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def layer_types(text: dict, n_layers: int, where: Path) -> tuple[str, ...]:
    """Each layer's kind ("full_attention" / "linear_attention"): the config's list, else every
    full_attention_interval-th layer full. A model without a full-attention layer is refused
    here, where `pdserve up` checks before it starts anything (engine/cache/allocator.py sizes
    pages from those layers, and refused it only in the nodes)."""
    types = tuple(
        text.get("layer_types")
        or [
            "full_attention" if (i + 1) % text.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(n_layers)
        ]
    )[:n_layers]
    if "full_attention" not in types:
        raise ValueError(
            f"{where}: the model has no full-attention layer ({n_layers} layers, full_attention_interval "
            f"{text.get('full_attention_interval', 4)}); pdserve serves hybrid models"
        )
    return types


def moe_fields(text: dict, model_type: str) -> dict:
    """The MoE sizes of a text config. Qwen3.5-MoE has every layer sparse and always renormalises
    its top-k weights (its config has no norm_topk_prob, decoder_sparse_step or mlp_only_layers);
    Qwen3-Next reads all three."""
    if model_type == "qwen3_5_text" or not text.get("num_experts"):
        return {}
    out = dict(
        num_experts=text["num_experts"],
        num_experts_per_tok=text["num_experts_per_tok"],
        moe_intermediate_size=text["moe_intermediate_size"],
        shared_expert_intermediate_size=text["shared_expert_intermediate_size"],
    )
    if model_type == "qwen3_next":
        out.update(
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            decoder_sparse_step=text.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
        )
    return out


def fp8_block_size(qc: dict | None, where: Path) -> tuple[int, int] | None:
    """The weight block of a `quant_method: fp8` config; any other method is refused."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method not in SUPPORTED_QUANTIZATION:
        raise ValueError(
            f"unsupported quantization method {method!r} (quantization_config in {where}); "
            f"supported: {', '.join(SUPPORTED_QUANTIZATION)} with weight_block_size"
        )
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"fp8 quantization needs weight_block_size [bn, bk] (got {block!r}) in {where}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"unsupported fp8 format {qc.get('fmt')!r} in {where}; supported: e4m3")
    return (block[0], block[1])


def has_processor(path) -> bool:
    """A vision-language checkpoint serves images when it ships its image processor; without one
    its text model is served and the vision tower left out (docs/images.md)."""
    return (Path(path) / "preprocessor_config.json").is_file()


def max_model_len(requested: int | None, model: ModelConfig) -> int:
    """The context (prompt + output tokens) a server runs with: `requested`, or the checkpoint's
    positions (max_position_embeddings, scaled by its rope scaling) when None or 0. ValueError,
    naming both numbers, for a negative one or one past `positions` (unless ALLOW_LONG_ENV is set:
    positions the model was never trained on, its output there not vouched for)."""
    positions = model.rope_scaling.max_positions(model.max_position_embeddings)
    if requested is None or requested == 0:
        return positions
    if requested < 0:
        raise ValueError(f"max_model_len {requested} must be >= 1 (0: the checkpoint's {positions})")
    if requested > positions and os.environ.get(ALLOW_LONG_ENV, "").strip().lower() not in ("1", "true"):
        raise ValueError(
            f"max_model_len {requested} exceeds the checkpoint's {positions} positions "
            f"({model.rope_scaling.positions_source(model.max_position_embeddings)}); "
            f"set {ALLOW_LONG_ENV}=1 to run past them anyway"
        )
    return requested
