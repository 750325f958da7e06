"""Bad requests raise ValueError naming the problem; the engine keeps serving the others."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

OK = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def small_llm(ckpt_hv2):
    with LLM(ckpt_hv2, dtype="float32", max_model_len=128) as llm:
        yield llm


@pytest.mark.parametrize(
    "prompt, words",
    [
        ([], "empty prompt"),
        ([1, 2, 1024], "out of range"),
        ([-1], "out of range"),
        ([7] * 128, "max_model_len"),
        ([7] * 500, "max_model_len"),
    ],
    ids=["empty", "id_eq_vocab", "negative_id", "len_eq_max", "len_over_max"],
)
def test_bad_prompt_raises_and_engine_goes_on(small_llm, prompt, words):
    before = small_llm.engine.blocks.num_free, small_llm.engine.slots.num_free
    with pytest.raises(ValueError, match=words):
        small_llm.generate(prompt_token_ids=[[1, 2, 3], prompt], sampling_params=OK)
    assert (small_llm.engine.blocks.num_free, small_llm.engine.slots.num_free) == before
    out = small_llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=OK)[0]
    assert len(out.output_token_ids) == 6


def test_bad_input_mid_flight_leaves_others_running(small_llm):
    e = small_llm.engine
    rid = e.add_request([3, 4, 5, 6], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    e.step()
    with pytest.raises(ValueError, match="out of range"):
        e.add_request([5000], OK)
    with pytest.raises(ValueError, match="sampling_params"):
        e.add_request([5], {"max_tokens": 3})
    got = []
    while e.has_unfinished():
        got += [o for o in e.step() if o.finished]
    assert [o.request_id for o in got] == [rid] and len(got[0].output_token_ids) == 10


def test_bad_sampling_in_generate(small_llm):
    with pytest.raises(ValueError, match="unknown sampling option"):
        small_llm.generate(prompt_token_ids=[[1]], sampling_params=SamplingParams(max_tokens=2, nucleus=0.3))
    with pytest.raises(ValueError, match="max_tokens"):
        small_llm.generate(prompt_token_ids=[[1]], sampling_params=SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        small_llm.generate(prompt_token_ids=[[1]], sampling_params=[OK, OK])


def test_prompts_without_tokenizer_refused(small_llm):
    with pytest.raises(ValueError, match="no tokenizer"):
        small_llm.generate(prompts=["hello"], sampling_params=OK)
