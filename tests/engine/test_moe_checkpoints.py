"""MoE checkpoints the loader refuses in one line before reading a tensor, and FP8 block-quantized
checkpoints (dequantized at load, or experts kept in float8), against transformers on the
dequantized weights."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors import safe_open

from engine import LLM, SamplingParams
from tests.helpers import hybrid_ckpt as hc

ARCHS = tuple(hc.SPEC_MOE)
NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def tokens_of(outs):
    return [o.output_token_ids for o in outs]


# ---- bad checkpoints: one line naming the tensor (and both shapes), before anything is read ----


def _broken(src, dst, edit_weights=None, edit_config=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit_weights:
        w = load_file(dst / "model.safetensors")
        edit_weights(w)
        save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def _refused(path, pattern, monkeypatch):
    from engine import checkpoint

    reads = []
    orig = checkpoint.Reader.get
    monkeypatch.setattr(checkpoint.Reader, "get", lambda self, n: reads.append(n) or orig(self, n))
    with pytest.raises(ValueError, match=pattern) as e:
        LLM(path, dtype="float32")
    assert "\n" not in str(e.value)
    assert reads == [], "a tensor was read before the checkpoint was refused"


def test_missing_expert_is_named(moe_ckpt, tmp_path, monkeypatch):
    name = "model.layers.2.mlp.experts.4.up_proj.weight"
    d = _broken(moe_ckpt("qwen3_5_moe"), tmp_path / "ck", lambda w: w.pop(name))
    _refused(d, rf"lacks 1 weight\(s\): {name} \(expected shape \[24, 64\]\)", monkeypatch)


def test_wrong_expert_shape_names_both_shapes(moe_ckpt, tmp_path, monkeypatch):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    d = _broken(moe_ckpt("qwen3_next"), tmp_path / "ck", lambda w: w.__setitem__(name, torch.zeros(64, 20)))
    _refused(d, rf"{name} has shape \[64, 20\], expected \[64, 24\]", monkeypatch)


def test_wrong_fused_gdn_shape_is_named(moe_ckpt, tmp_path, monkeypatch):
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    d = _broken(moe_ckpt("qwen3_next"), tmp_path / "ck", lambda w: w.__setitem__(name, torch.zeros(500, 64)))
    _refused(d, rf"{name} has shape \[500, 64\], expected \[384, 64\]", monkeypatch)


def test_unknown_quantization_is_refused(moe_ckpt, tmp_path, monkeypatch):
    d = _broken(
        moe_ckpt("qwen3_5_moe"),
        tmp_path / "ck",
        edit_config=lambda c: c.__setitem__("quantization_config", {"quant_method": "awq", "bits": 4}),
    )
    _refused(d, r"unsupported quantization method 'awq'.*supported: fp8", monkeypatch)


# ---- FP8 block-quantized checkpoints, written by make-tiny-model --fp8 ----------------------


def _dequantized_copy(src, dst):
    """The same checkpoint with every FP8 weight dequantized to float32 and no quantization_config:
    what transformers runs as the reference."""
    from safetensors.torch import load_file, save_file

    from kernels.fp8 import dequant_fp8_block

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    block = cfg.pop("quantization_config")["weight_block_size"]
    (dst / "config.json").write_text(json.dumps(cfg))
    w = load_file(dst / "model.safetensors")
    for name in [n for n in w if n.endswith("_scale_inv")]:
        base = name.removesuffix("_scale_inv")
        w[base] = dequant_fp8_block(w[base], w.pop(name).float(), block, torch.float32).contiguous()
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def _make_fp8(d, arch: str, **overrides):
    """make-tiny-model --fp8 (blocks of 16) with the MoE test spec's sizes, `overrides` replacing some."""
    from tests.cli.test_cli_engine import run_cli

    spec = dataclasses.replace(hc.SPEC_MOE[arch], **overrides)
    args = ["make-tiny-model", str(d), "--arch", arch, "--fp8", "--fp8-block", "16", "--no-tokenizer"]
    fields = "layers hidden heads kv_heads head_dim linear_key_heads linear_value_heads linear_key_head_dim"
    fields += " linear_value_head_dim vocab intermediate experts top_k moe_intermediate shared_intermediate seed"
    for f in fields.split():
        args += ["--" + f.replace("_", "-"), str(getattr(spec, f))]
    if arch == "qwen3_next":
        args += ["--mlp-only-layers", spec.mlp_only_layers, "--no-norm-topk-prob"]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr


# Qwen3-Next's FP8 release in the slow tier: the loader's FP8 path is the same for both
@pytest.mark.parametrize("arch", [a if a == "qwen3_5_moe" else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS])
def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(arch, moe_prompts, tmp_path):
    d = tmp_path / "fp8"
    _make_fp8(d, arch)
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [16, 16]
    with safe_open(str(d / "model.safetensors"), framework="pt") as h:
        expert = "model.layers.1.mlp.experts.2.down_proj.weight"
        assert h.get_tensor(expert).dtype == torch.float8_e4m3fn
        assert tuple(h.get_tensor(expert + "_scale_inv").shape) == (4, 2)  # [64, 24] in 16 x 16 blocks
        assert h.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float32  # the router stays
        assert "model.layers.1.mlp.shared_expert_gate.weight_scale_inv" not in h.keys()
    ref_dir = _dequantized_copy(d, tmp_path / "dequantized")
    ref = [hc.hf_greedy(ref_dir, p, NEW) for p in moe_prompts]
    assert hc.engine_greedy(d, moe_prompts, NEW) == ref
    if arch == "qwen3_next":  # the fused GDN projections, dequantized then sliced per rank
        assert hc.engine_greedy(d, moe_prompts[2:], NEW, tensor_parallel_size=2) == ref[2:]


def test_fp8_weight_without_scale_is_refused(moe_ckpt, tmp_path, monkeypatch):
    name = "model.layers.3.self_attn.o_proj.weight"
    d = _broken(
        moe_ckpt("qwen3_5_moe"), tmp_path / "ck", lambda w: w.__setitem__(name, w[name].to(torch.float8_e4m3fn))
    )
    _refused(d, rf"{name} is float8 but config.json has no fp8 quantization_config", monkeypatch)


def test_fp8_experts_kept_in_fp8_match_transformers(moe_prompts, tmp_path):
    """fp8_experts="keep" (the default on CUDA): the routed experts stay float8 with their block
    scales (half the bytes of bfloat16) and the tokens are still transformers' on the dequantized
    weights, at TP 1 and 2 (each rank's 16 of 32 intermediate rows are one whole block)."""
    d = tmp_path / "fp8"
    _make_fp8(d, "qwen3_5_moe", moe_intermediate=32)
    prompts = moe_prompts[:2]
    ref_dir = _dequantized_copy(d, tmp_path / "dequantized")
    ref = [hc.hf_greedy(ref_dir, p, NEW) for p in prompts]
    with LLM(str(d), dtype="float32", fp8_experts="keep") as llm:
        moe = [layer.mlp.w for layer in llm.engine.executor.worker.model.layers if hasattr(layer.mlp.w, "w13")]
        assert moe and all(w.w13.dtype == w.w2.dtype == torch.float8_e4m3fn for w in moe)
        assert tuple(moe[0].w13_scale_inv.shape) == (6, 2 * 32 // 16, 64 // 16) and moe[0].block_size == (16, 16)
        assert tokens_of(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)) == ref
    assert hc.engine_greedy(d, prompts, NEW, tensor_parallel_size=2, fp8_experts="keep") == ref


@pytest.mark.gpu
def test_fp8_experts_on_cuda_match_transformers(moe_prompts, tmp_path):
    """On CUDA the routed experts of an FP8 checkpoint stay float8 by default (fp8_experts
    "auto"), through the Triton fused MoE kernel: float32 tokens equal transformers' on the
    dequantized weights on the same GPU."""
    d = tmp_path / "fp8"
    _make_fp8(d, "qwen3_5_moe", moe_intermediate=32)
    ref_dir = _dequantized_copy(d, tmp_path / "dequantized")
    ref = [hc.hf_greedy(ref_dir, p, NEW, device="cuda") for p in moe_prompts]
    with LLM(str(d), dtype="float32", device="cuda") as llm:
        moe = [layer.mlp.w for layer in llm.engine.executor.worker.model.layers if hasattr(layer.mlp.w, "w13")]
        assert moe and all(w.w13.dtype == torch.float8_e4m3fn and w.w13.is_cuda for w in moe)
        assert tokens_of(llm.generate(prompt_token_ids=moe_prompts, sampling_params=GREEDY)) == ref
