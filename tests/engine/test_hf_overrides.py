"""`hf_overrides` (vLLM's --hf-overrides; engine/config_overrides.py): YaRN added to a checkpoint
of a 64-position context, with no scaling of its own, without editing it. The override lets the
engine serve 256 positions, which the checkpoint alone refuses, and its prompt log-probabilities
past the original context, at TP 1 and TP 2, equal transformers' forward of the checkpoint with
those fields written into its config.json. vLLM's older spellings (`rope_scaling`, `rope_theta`)
land in the text config's `rope_parameters`; an override that leaves the config unreadable is one
line naming the file, and so is a checkpoint's own config.json that lacks a size."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineArgs, ModelConfig
from engine.config_overrides import apply
from tests.helpers import hybrid_ckpt as hc

ORIGINAL, FACTOR = 64, 4
YARN = {"rope_type": "yarn", "factor": float(FACTOR), "original_max_position_embeddings": ORIGINAL}
OVERRIDE = {"rope_parameters": YARN}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(the checkpoint, no rope scaling; a copy whose config.json has the YaRN fields written in)."""
    base = Path(tmp_path_factory.mktemp("overrides"))
    plain = hc.make(base / "plain", dataclasses.replace(hc.SPEC_HV2, layers=4, max_positions=ORIGINAL))
    cfg = json.loads((Path(plain) / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "default" and "rope_scaling" not in cfg
    return plain, hc.with_rope(plain, base / "edited", YARN)


def test_the_override_allows_the_longer_context(ckpts, monkeypatch):
    plain, _ = ckpts
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ValueError, match=r"max_model_len 256 exceeds the checkpoint's 64 positions"):
        EngineArgs(model=plain, max_model_len=256).engine_config(check_only=True)
    over = json.dumps(OVERRIDE)
    assert EngineArgs(model=plain, max_model_len=256, hf_overrides=over).engine_config(check_only=True).max_model_len
    assert EngineArgs(model=plain, hf_overrides=over).engine_config(check_only=True).max_model_len == 256
    with pytest.raises(ValueError, match=r"\(original_max_position_embeddings 64 x yarn factor 4\)"):
        EngineArgs(model=plain, max_model_len=257, hf_overrides=over).engine_config(check_only=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_prompt_logprobs_equal_transformers_on_the_edited_config(ckpts, tp):
    plain, edited = ckpts
    prompt = hc.prompts(lens=(200,), seed=31)[0]  # past the original context of 64
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    with LLM(plain, dtype="float32", tensor_parallel_size=tp, hf_overrides=OVERRIDE, max_model_len=256) as llm:
        assert llm.config.max_model_len == 256
        (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)
    got = torch.tensor([next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]])
    target = torch.tensor(prompt[1:])[:, None]
    with torch.inference_mode():
        want = hc._hf_model(edited)(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
        unscaled = hc._hf_model(plain)(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    torch.testing.assert_close(got, want.gather(1, target)[:, 0], rtol=0, atol=1e-4)
    # the override is what made them equal: the checkpoint as written scores the prompt otherwise
    assert (got - unscaled.gather(1, target)[:, 0]).abs().max() > 1e-2


def test_older_spellings_land_in_the_text_configs_rope_parameters(ckpts):
    plain, edited = ckpts
    want = ModelConfig.from_dir(edited, check_only=True)
    legacy = {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}}
    got = ModelConfig.from_dir(plain, check_only=True, hf_overrides=json.dumps(legacy))
    assert (got.rope_scaling, got.rope_theta, got.partial_rotary_factor) == (
        want.rope_scaling,
        want.rope_theta,
        want.partial_rotary_factor,
    )
    theta = ModelConfig.from_dir(plain, check_only=True, hf_overrides='{"rope_theta": 500000}')
    assert (
        theta.rope_theta == 500000 and theta.rope_scaling == ModelConfig.from_dir(plain, check_only=True).rope_scaling
    )
    # a vision-language config: its text model's, and the rest of rope_parameters kept
    rope = {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25}
    wrapper = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"rope_parameters": rope}}
    merged = apply(wrapper, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_theta": 5e6})
    assert merged == {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {"rope_parameters": {**rope, "rope_type": "yarn", "factor": 4.0, "rope_theta": 5e6}},
    }
    # the card's form: the whole of text_config.rope_parameters given, other keys of text_config kept
    card = {"text_config": {"rope_parameters": {**rope, **YARN}}}
    merged = apply({**wrapper, "text_config": {**wrapper["text_config"], "vocab_size": 7}}, card)
    assert merged["text_config"] == {"vocab_size": 7, "rope_parameters": {**rope, **YARN}}


@pytest.mark.parametrize(
    "override, says",
    [
        ('{"vocab_size": null}', "vocab_size must be an integer (got None)"),
        ('{"max_position_embeddings": "long"}', "max_position_embeddings must be an integer (got 'long')"),
        ('{"num_key_value_heads": "two"}', "unsupported operand type(s) for %: 'int' and 'str'"),
        ('{"rope_parameters": 5}', "'int' object has no attribute 'get'"),
        ('{"rope_parameters": {"rope_type": "dynamic", "factor": 2}}', "unsupported rope_type 'dynamic'"),
        ("[1, 2]", "--hf-overrides must be a JSON object"),
        ("{rope", "--hf-overrides is not JSON"),
    ],
)
def test_an_override_that_leaves_the_config_unreadable_is_one_line(ckpts, override, says):
    plain, _ = ckpts
    with pytest.raises(ValueError) as e:
        EngineArgs(model=plain, hf_overrides=override).engine_config(check_only=True)
    assert says in str(e.value) and "\n" not in str(e.value)
    if "JSON" not in says:
        assert "with --hf-overrides" in str(e.value)


def test_a_config_missing_a_size_is_one_line_on_the_command_line(ckpts, tmp_path, capsys):
    """Without any override too: a config.json with no num_hidden_layers printed a KeyError's stack trace."""
    from router.cli import main

    cfg = json.loads((Path(ckpts[0]) / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["up", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pdserve up: error: cannot read {tmp_path / 'config.json'}: no 'num_hidden_layers'"], err
