"""The parts of a checkpoint's config.json that config.py's ModelConfig reads through a rule of
their own: the architectures, the MoE sizes of each architecture, the FP8 quantization block,
whether images are served."""

from __future__ import annotations

from pathlib import Path

SUPPORTED_QUANTIZATION = ("fp8",)
# architecture -> the text model's model_type (a wrapper's text_config holds the text model)
ARCHITECTURES = {
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_text",
    "Qwen3NextForCausalLM": "qwen3_next",
}
WRAPPERS = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")  # text under text_config


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
