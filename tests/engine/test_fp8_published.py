"""FP8 checkpoints laid out as the Qwen FP8 releases publish them: `*.weight_scale_inv` stored in
bfloat16, the MTP block's decoder layer quantized too (its `mtp.fc`, routers and shared-expert
gates left in the compute dtype), against transformers on weights dequantized here by a naive
loop; and checkpoints that contradict their own quantization_config, refused in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from kernels.fp8 import quant_fp8_block
from tests.helpers import hybrid_ckpt as hc

NEW = 8
BLOCK = 16


def _edit(d, fn) -> None:
    for f in d.glob("*.safetensors"):
        w = load_file(f)
        fn(w)
        save_file(w, f, metadata={"format": "pt"})


def _naive_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(q.shape[0]):
        for j in range(0, q.shape[1], BLOCK):
            out[i, j : j + BLOCK] = q[i, j : j + BLOCK].float() * float(s[i // BLOCK, j // BLOCK])
    return out


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny Qwen3.5-MoE FP8 checkpoint with an MTP block, as make-tiny-model --fp8 writes the
    releases' layout, and its dequantized copy."""
    root = tmp_path_factory.mktemp("fp8-published")
    spec = dataclasses.replace(hc.SPEC_MOE["qwen3_5_moe"], mtp=True, fp8=True, fp8_block=BLOCK)
    d = root / "fp8"
    hc.make(d, spec)
    ref = root / "dequantized"
    shutil.copytree(d, ref)
    cfg = json.loads((ref / "config.json").read_text())
    del cfg["quantization_config"]
    (ref / "config.json").write_text(json.dumps(cfg))

    def dequant(w):
        for n in [n for n in w if n.endswith("_scale_inv")]:
            base = n.removesuffix("_scale_inv")
            w[base] = _naive_dequant(w[base], w.pop(n))

    _edit(ref, dequant)
    return d, ref


def test_bf16_scales_and_fp8_mtp_match_transformers(published, moe_prompts):
    """bfloat16 scales load (they were refused: 'scale_inv must be float32'); the logits'
    greedy tokens are transformers' on the dequantized weights, with and without MTP drafts from
    the FP8 MTP layer, dequantized or kept in FP8, at TP 1 and 2."""
    d, ref = published
    w = load_file(next(d.glob("*.safetensors")))
    assert w["mtp.layers.0.mlp.experts.0.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert w["mtp.layers.0.self_attn.q_proj.weight_scale_inv"].dtype == torch.bfloat16
    assert w["mtp.fc.weight"].dtype == torch.float32
    want = [hc.hf_greedy(str(ref), p, NEW) for p in moe_prompts]
    assert hc.engine_greedy(d, moe_prompts, NEW) == want
    mtp = {"speculative_method": "mtp", "num_speculative_tokens": 2}
    assert hc.engine_greedy(d, moe_prompts, NEW, **mtp) == want
    assert hc.engine_greedy(d, moe_prompts, NEW, fp8_experts="keep", fp8_dense="keep", **mtp) == want
    assert hc.engine_greedy(d, moe_prompts[1:3], NEW, tensor_parallel_size=2, **mtp) == want[1:3]


def test_fp8_mtp_layer_drafts_are_accepted(published, moe_prompts):
    """The FP8 MTP layer drafts: the drafts are the argmax of transformers' MTP block built from the
    dequantized weights."""
    d, ref = published
    prompt = moe_prompts[2]
    with LLM(str(d), dtype="float32", speculative_method="mtp", num_speculative_tokens=1) as llm:
        first, drafts = hc.first_step_drafts(llm, prompt, SamplingParams(max_tokens=NEW, temperature=0.0))
    logits, _ = hc.hf_mtp_logits(str(ref), prompt + [first])
    assert drafts == [int(logits[-1].argmax())]


def _refused(path, pattern) -> None:
    with pytest.raises(ValueError, match=pattern) as e:
        LLM(str(path), dtype="float32", speculative_method="mtp", num_speculative_tokens=1)
    assert "\n" not in str(e.value)


def test_unconverted_module_stored_in_fp8_is_refused(published, tmp_path):
    """A router listed in modules_to_not_convert but stored float8 with scales: one line naming it
    and the entry (it used to load as if quantized, against the config)."""
    d = tmp_path / "ckpt"
    shutil.copytree(published[0], d)
    name = "model.layers.1.mlp.gate.weight"

    def quantize_router(w):
        w[name], w[name + "_scale_inv"] = quant_fp8_block(w[name], (BLOCK, BLOCK))

    _edit(d, quantize_router)
    _refused(d, rf"{name} is float8 but quantization_config.modules_to_not_convert lists 'mlp.gate'$")
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg["quantization_config"]
    qc["ignored_layers"] = ["model.layers.1.mlp.gate"]  # the other key, a full module name
    del qc["modules_to_not_convert"]
    (d / "config.json").write_text(json.dumps(cfg))
    _refused(d, rf"{name} is float8 but quantization_config.ignored_layers lists 'model.layers.1.mlp.gate'$")


def test_missing_mtp_scale_is_named(published, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(published[0], d)
    name = "mtp.layers.0.mlp.experts.1.up_proj.weight"
    _edit(d, lambda w: w.pop(name + "_scale_inv"))
    _refused(d, rf"{name} has no {name}_scale_inv")


def test_bf16_compute_follows_transformers_bf16(published, moe_prompts):
    """bfloat16 compute: each greedy token within bfloat16 rounding of transformers' bfloat16 max
    on the dequantized weights (near-ties may go either way, tests/engine/test_bf16.py)."""
    d, ref = published
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    with LLM(str(d), dtype="bfloat16", speculative_method="mtp", num_speculative_tokens=2) as llm:
        outs = llm.generate(prompt_token_ids=moe_prompts, sampling_params=sp)
    for p, o in zip(moe_prompts, outs):
        short = hc.hf_logit_shortfall(str(ref), p, o.output_token_ids, dtype=torch.bfloat16)
        assert float(short.max()) <= 0.25, (len(p), short.tolist())


def test_tiny_vision_fp8_keeps_the_tower_unquantized(tmp_path):
    """make-tiny-model --vision --fp8 leaves the vision tower unquantized, as the releases do (it
    used to quantize it, writing a checkpoint the engine refuses), and the checkpoint serves."""
    from engine.tiny_model import TinyModelSpec, make_tiny_model

    d = make_tiny_model(tmp_path / "vl", TinyModelSpec(layers=4, vision=True, fp8=True, fp8_block=32))
    w = load_file(next(d.glob("*.safetensors")))
    visual = [n for n in w if n.startswith("model.visual.")]
    assert visual and not any(w[n].dtype == torch.float8_e4m3fn for n in visual)
    assert w["model.language_model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    with LLM(str(d), dtype="float32") as llm:
        out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out[0].output_token_ids) == 2
