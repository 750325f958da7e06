"""Loading checkpoints as transformers writes them, and refusing what we cannot serve."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from tests.helpers import hybrid_ckpt as hc

SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_lists_supported(ckpt_hv2, tmp_path):
    d = _copy(ckpt_hv2, tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported: Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration"):
        LLM(str(d))


def test_missing_and_unexpected_weights_are_named(ckpt_hv2, tmp_path):
    d = _copy(ckpt_hv2, tmp_path / "ck")
    w = load_file(d / "model.safetensors")
    del w["model.layers.3.self_attn.k_norm.weight"]
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 weight\(s\): model.layers.3.self_attn.k_norm.weight"):
        LLM(str(d))
    w["model.layers.3.self_attn.k_norm.weight"] = torch.zeros(64)
    w["model.layers.0.linear_attn.surprise"] = torch.zeros(3)
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected weight.*model.layers.0.linear_attn.surprise"):
        LLM(str(d))


def test_sharded_checkpoint_with_index(ckpt_hv2, tmp_path):
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(ckpt_hv2)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="1MB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    p = hc.prompts(lens=(5, 70))
    with LLM(ckpt_hv2, dtype="float32") as a, LLM(str(tmp_path / "sharded"), dtype="float32") as b:
        assert [o.output_token_ids for o in a.generate(prompt_token_ids=p, sampling_params=SP)] == [
            o.output_token_ids for o in b.generate(prompt_token_ids=p, sampling_params=SP)
        ]


def test_conditional_generation_text_part(tmp_path):
    """Qwen3_5ForConditionalGeneration: the text model is served, the vision tower ignored."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        max_position_embeddings=1024,
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128, patch_size=4)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    model.save_pretrained(tmp_path / "vl")
    mcfg = ModelConfig.from_dir(tmp_path / "vl")
    assert mcfg.weight_prefix == "model.language_model." and mcfg.num_layers == 4
    prompt = [3, 14, 15, 92, 65, 35]
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[
            0, 6:
        ].tolist()
    with LLM(str(tmp_path / "vl"), dtype="float32") as llm:
        assert llm.generate(prompt_token_ids=[prompt], sampling_params=SP)[0].output_token_ids == ref


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_load_and_run(ckpt_hv2, dtype):
    with LLM(ckpt_hv2, dtype=dtype) as llm:
        assert llm.config.model.dtype == getattr(torch, dtype)
        assert llm.engine.executor.worker.pools.recurrent[0].dtype == torch.float32
        out = llm.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=SP)[0]
        assert len(out.output_token_ids) == 8


def test_dtype_auto_takes_config(ckpt_hv2, tmp_path):
    assert ModelConfig.from_dir(ckpt_hv2).dtype == torch.float32
    d = _copy(ckpt_hv2, tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_dir(d).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        ModelConfig.from_dir(d, "int8")
