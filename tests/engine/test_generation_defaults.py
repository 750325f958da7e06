"""engine/generation_defaults.py against transformers' own reading of generation_config.json
(GenerationConfig.to_diff_dict, as vLLM reads it), and the offline LLM's `generate` with no
sampling_params taking them (vLLM's get_default_sampling_params)."""

from __future__ import annotations

import shutil

import pytest

from engine.generation_defaults import KEYS, defaults
from tests.helpers import hybrid_ckpt as hc


def _transformers(path) -> dict:
    from transformers import GenerationConfig

    diff = GenerationConfig.from_pretrained(path).to_diff_dict()
    return {KEYS[k]: v for k, v in diff.items() if k in KEYS and v is not None}


@pytest.mark.parametrize(
    "fields",
    [
        dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95),  # Qwen's thinking settings
        dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_new_tokens=64),
        dict(do_sample=True, temperature=1.0, top_k=50, top_p=1.0, min_p=0.05),  # neutral values, written: the model's
        dict(eos_token_id=[1, 2]),  # nothing about sampling
    ],
)
def test_defaults_are_transformers_reading_of_the_file(tmp_path, fields):
    from transformers import GenerationConfig

    GenerationConfig(**fields).save_pretrained(tmp_path)
    got = defaults(str(tmp_path))
    assert got == _transformers(tmp_path)
    assert defaults(str(tmp_path), "vllm") == {} and defaults(None) == {}
    assert defaults("/nowhere", str(tmp_path)) == got  # a directory named instead of the checkpoint
    over = defaults(str(tmp_path), "none", '{"temperature": 0.25, "max_new_tokens": 9}')
    assert over == {"temperature": 0.25, "max_tokens": 9}  # the override applies with no file too


@pytest.mark.parametrize(
    "mode,override,words",
    [
        ("auto", '{"presence_penalty": 1.5}', "presence_penalty not taken"),
        ("auto", '{"top_p": 0}', "top_p must be in (0, 1]"),
        ("auto", '{"top_k": 2.5}', "top_k: an integer"),
        ("auto", '{"temperature": "hot"}', "temperature: a number"),
        ("auto", "[1]", "must be a JSON object"),
        ("auto", "{x", "is not JSON"),
        ("/no/such/dir", None, "not auto, vllm, none or a directory"),
    ],
)
def test_what_cannot_be_a_default_is_one_line(tmp_path, mode, override, words):
    with pytest.raises(ValueError, match=None) as e:
        defaults(str(tmp_path), mode, override)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_offline_generate_without_params_takes_the_checkpoints(tmp_path):
    from transformers import GenerationConfig

    from engine import LLM

    src = hc.make(tmp_path / "src", hc.SPEC_HV2)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    g = GenerationConfig.from_pretrained(src)
    g.update(do_sample=True, top_k=1, temperature=0.8, max_new_tokens=6)
    g.save_pretrained(dst)
    prompt = hc.prompts(lens=(20,), seed=4)[0]
    greedy = hc.hf_greedy(str(dst), prompt, 6)
    llm = LLM(str(dst), dtype="float32", kv_cache_memory="64MiB", engine_process=False)
    try:
        d = llm.get_default_sampling_params()
        assert (d.top_k, d.temperature, d.max_tokens) == (1, 0.8, 6)
        out = llm.generate(prompt_token_ids=[prompt])[0].output_token_ids
        assert out == greedy[: len(out)] and (len(out) == 6 or out[-1] in (g.eos_token_id or ()))
    finally:
        llm.close()
