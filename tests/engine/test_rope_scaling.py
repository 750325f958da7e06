"""Rotary position scaling as checkpoints write it (engine/rope.py): YaRN and linear frequencies
and YaRN's attention factor against transformers' own rope functions; a YaRN checkpoint whose
prompts run well past its original context generates transformers' greedy tokens; unsupported
types and incomplete YaRN parameters are refused in one line; the context a scaling serves.
Prompt log-probabilities past the original context equal transformers' (YaRN's attention factor
included); YaRN's original context and a missing factor are read as transformers reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.rope import RopeScaling
from tests.helpers import hybrid_ckpt as hc

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def _with_rope(src: str, dst: Path, extra: dict) -> str:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"].update(extra)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("rope") / "ckpt", hc.SPEC_HV2)


@pytest.mark.parametrize(
    "extra",
    [
        YARN,
        {**YARN, "beta_fast": 16, "beta_slow": 2},
        {**YARN, "attention_factor": 1.25},
        {**YARN, "truncate": False},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0},  # the original context: max_position_embeddings
        {**YARN, "mscale": 0.8, "mscale_all_dim": 0.5},
    ],
    ids=[
        "yarn",
        "yarn-betas",
        "yarn-attention-factor",
        "yarn-untruncated",
        "linear",
        "yarn-no-original",
        "yarn-mscale",
    ],
)
def test_frequencies_match_transformers(base, tmp_path, extra):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = _with_rope(base, tmp_path / "c", extra)
    hf = AutoConfig.from_pretrained(path)
    want, want_att = ROPE_INIT_FUNCTIONS[extra["rope_type"]](hf, "cpu")
    m = ModelConfig.from_dir(path)
    got = m.rope_scaling.inv_freq(m.rotary_dim, m.rope_theta)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert m.rope_scaling.attention_factor == pytest.approx(want_att, rel=1e-9)


def test_yarn_checkpoint_generates_transformers_tokens_past_its_original_context(base, tmp_path):
    path = _with_rope(base, tmp_path / "yarn", YARN)
    prompts = [p for p in hc.prompts(lens=(20, 90, 150))]
    refs = [hc.hf_greedy(path, p, 12) for p in prompts]
    with LLM(path, dtype="float32") as llm:
        outs = llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        )
        scored = llm.generate(
            prompt_token_ids=prompts[-1:], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0)
        )[0]
    assert [o.output_token_ids for o in outs] == refs
    # every prompt position's log-probability, those past the original context (32) too, is
    # transformers': a wrong attention factor (YaRN's scale of cos and sin) can keep the argmax
    with torch.inference_mode():
        want = hc._hf_model(path)(torch.tensor(prompts[-1:])).logits[0, :-1].float().log_softmax(-1)
    want = want.gather(1, torch.tensor(prompts[-1][1:])[:, None])[:, 0]
    got = torch.tensor([next(iter(lp.values())).logprob for lp in scored.prompt_logprobs[1:]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # and the scaling matters here: the same weights without it answer differently
    plain = [hc.hf_greedy(base, p, 12) for p in prompts]
    assert plain != refs


@pytest.mark.parametrize(
    "rope, msg",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "unsupported rope_type 'dynamic'; supported: default, linear, yarn"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
            "original_max_position_embeddings",
        ),
        ({"rope_type": "linear", "factor": 0.5}, "factor must be a number >= 1"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "rope yarn needs factor"),
        ({"type": "linear"}, "rope linear needs factor"),
    ],
)
def test_refused_in_one_line(rope, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        RopeScaling.parse(rope)


def test_yarn_original_context_defaults_as_transformers_reads_it():
    """No original_max_position_embeddings among YaRN's parameters: a top-level one, else
    max_position_embeddings (a config that had one was refused; transformers takes it)."""
    yarn = {"rope_type": "yarn", "factor": 4.0}
    assert (
        RopeScaling.from_text({"rope_parameters": yarn, "max_position_embeddings": 4096}).max_positions(4096) == 16384
    )
    top = {"rope_parameters": yarn, "max_position_embeddings": 4096, "original_max_position_embeddings": 1024}
    assert RopeScaling.from_text(top).original_max_positions == 1024
    ratio = {"rope_parameters": {**yarn, "factor": None, "original_max_position_embeddings": 1024}}
    assert RopeScaling.from_text({**ratio, "max_position_embeddings": 4096}).factor == 4.0


def test_older_configs_rope_scaling_key_is_read():
    s = RopeScaling.parse(
        {"rope_theta": 1e6}, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}
    )
    assert s.kind == "yarn" and s.max_positions(262144) == 1_048_576
    assert RopeScaling.parse({}).max_positions(4096) == 4096


def test_served_context_follows_the_scaling(base, tmp_path, monkeypatch):
    from engine.config import EngineArgs

    path = _with_rope(base, tmp_path / "long", {**YARN, "original_max_position_embeddings": 4096})
    assert EngineArgs(model=path).engine_config().max_model_len == 4 * 4096
    assert EngineArgs(model=base).engine_config().max_model_len == 4096
    # past it: one line naming where the positions come from (the config's max_position_embeddings is 4096)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    for model, n, source in (
        (path, 4 * 4096, "original_max_position_embeddings 4096 x yarn factor 4"),
        (base, 4096, "max_position_embeddings 4096"),
    ):
        with pytest.raises(
            ValueError,
            match=rf"max_model_len {n + 1} exceeds the checkpoint's {n} positions \({source}\); set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",
        ):
            EngineArgs(model=model, max_model_len=n + 1).engine_config(check_only=True)
