"""A script moved from vLLM's offline API (`from vllm import LLM, SamplingParams`) runs on the
offline LLM with the same meaning (engine/llm_vllm.py, engine/sampling_vllm.py,
engine/llm_text.py): text stop strings cut the text and the tokens where transformers' greedy
text first holds them, `n` gives n completions, skip_special_tokens and structured_outputs /
guided_decoding act, max_tokens=None runs to max_model_len, chat renders the conversation as
transformers' apply_chat_template does, and the constructor's speculative_config, enforce_eager,
trust_remote_code and limit_mm_per_prompt are read; vLLM's fields without a counterpart are a
ValueError naming them."""

from __future__ import annotations

import json
import re

import pytest
from tokenizers import Tokenizer as HfTokenizer
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.sampling_vllm import GuidedDecodingParams, StructuredOutputsParams
from engine.tiny_model import TinyModelSpec
from tests.helpers import hybrid_ckpt as hc

N = 24
MAX_LEN = 400  # a rendered chat prompt with tools is 323 of the tiny tokenizer's tokens
IDS = [5, 17, 300, 42]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("vllm") / "ckpt", TinyModelSpec(layers=4, seed=7))


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(model=ckpt, dtype="float32", max_model_len=MAX_LEN, trust_remote_code=True, enforce_eager=True) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_tok(ckpt):
    return HfTokenizer.from_file(f"{ckpt}/tokenizer.json")


def _stop_case(ckpt, hf_tok):
    """transformers' greedy tokens and text, a stop string found in that text past its first
    characters, and the fewest tokens whose text holds it."""
    want = hc.hf_greedy(ckpt, IDS, N)
    text = hf_tok.decode(want)
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].isprintable())
    keep = next(k for k in range(1, N + 1) if stop in hf_tok.decode(want[:k]))
    return want, text, stop, keep


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_where_transformers_text_holds_it(llm, ckpt, hf_tok, include):
    want, text, stop, keep = _stop_case(ckpt, hf_tok)
    cut = text.index(stop) + (len(stop) if include else 0)
    sp = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, stop=[stop, "never seen"], logprobs=1)
    sp_inc = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    c = llm.generate({"prompt_token_ids": IDS}, sp_inc if include else sp, use_tqdm=False)[0].outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == (text[:cut], want[:keep], "stop", stop)
    if not include:
        assert len(c.logprobs) == keep


def test_stop_string_waits_for_min_tokens(llm, ckpt, hf_tok):
    want, text, stop, keep = _stop_case(ckpt, hf_tok)
    sp = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, stop=[stop], min_tokens=N)
    c = llm.generate({"prompt_token_ids": IDS}, sp)[0].outputs[0]
    assert c.token_ids == want and c.finish_reason == "length" and c.stop_reason is None


def test_n_completions(llm, ckpt):
    greedy = llm.generate({"prompt_token_ids": IDS}, SamplingParams(n=2, max_tokens=4, temperature=0, ignore_eos=True))
    assert len(greedy) == 1
    assert [(c.index, c.token_ids) for c in greedy[0].outputs] == [(k, hc.hf_greedy(ckpt, IDS, 4)) for k in (0, 1)]
    sp = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": IDS}, "Hello world"], [sp, SamplingParams(max_tokens=2)])
    assert [len(o.outputs) for o in outs] == [3, 1] and outs[1].prompt == "Hello world"
    for k, c in enumerate(outs[0].outputs):  # vLLM seeds the k-th completion with seed + k
        alone = llm.generate(
            {"prompt_token_ids": IDS}, SamplingParams(max_tokens=6, temperature=1.0, seed=11 + k, ignore_eos=True)
        )
        assert c.index == k and c.token_ids == alone[0].outputs[0].token_ids


def test_skip_special_tokens_and_detokenize(llm, ckpt, hf_tok):
    end = hf_tok.token_to_id("<|im_end|>")
    base = dict(max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={end: 100.0})
    for skip in (True, False):
        c = llm.generate(
            "Hello", SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=False, **base)
        )[0].outputs[0]
        assert end in c.token_ids and c.text == hf_tok.decode(c.token_ids, skip_special_tokens=skip)
    assert llm.generate("Hello", SamplingParams(detokenize=False, **base))[0].outputs[0].text == ""


def test_a_stop_token_s_text_is_left_out_as_vllm_does(llm):
    """A stop_token_ids entry (or EOS) that ends the output keeps its id and loses its text unless
    include_stop_str_in_output, as vLLM's detokenizer (the reference: the tokenizer's own decode)."""
    base = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    free = llm.generate({"prompt_token_ids": IDS}, SamplingParams(**base))[0].outputs[0]
    tok = llm.get_tokenizer()
    stop = next(t for t in free.token_ids[1:] if tok.decode([t]).strip())  # a visible token it makes
    for include in (False, True):
        c = llm.generate(
            {"prompt_token_ids": IDS},
            SamplingParams(stop_token_ids=[stop], include_stop_str_in_output=include, **base),
        )[0].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop and c.token_ids[-1] == stop
        shown = c.token_ids if include else c.token_ids[:-1]
        assert c.text == tok.decode(shown, skip_special_tokens=True), (include, c.text)


def test_structured_outputs_forms(llm):
    def text(**kw):
        return llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0.0, **kw))[0].outputs[0].text

    assert text(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])) in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}", text(guided_decoding=GuidedDecodingParams(regex="[0-9]{3}")))
    assert text(structured_outputs={"choice": ["red", "blue"]}) in ("red", "blue")
    # a structural tag (its JSON text, as vLLM's field holds it): one call and nothing else
    call = {"type": "tag", "begin": "<f=n>", "content": {"type": "regex", "pattern": "[0-9]{2}"}, "end": "</f>"}
    fmt = {
        "type": "triggered_tags",
        "triggers": ["<f="],
        "tags": [call],
        "at_least_one": True,
        "stop_after_first": True,
    }
    tag = json.dumps({"type": "structural_tag", "format": fmt})
    assert re.fullmatch(r"<f=n>[0-9]{2}</f>", text(structured_outputs=StructuredOutputsParams(structural_tag=tag)))


def test_max_tokens_none_runs_to_max_model_len(llm):
    ids = IDS * ((MAX_LEN - 12) // len(IDS))
    c = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(c.outputs[0].token_ids) == MAX_LEN - len(ids) and c.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids not supported"),
        ({"bad_words": ["x"]}, "bad_words not supported"),
        ({"n": 0}, "n must be a positive integer"),
        ({"stop": 3}, "stop must be a string or a list of strings"),
        ({"stop": ["x"], "detokenize": False}, "stop strings need detokenize=True"),
        (
            {"structured_outputs": StructuredOutputsParams(regex="a", choice=["b"])},
            "structured_outputs needs exactly one",
        ),
        ({"structured_outputs": {"choice": ["a"]}, "guided_decoding": {"regex": "b"}}, "give one of"),
        ({"structured_outputs": StructuredOutputsParams(json={}, whitespace_pattern=" ")}, "whitespace_pattern"),
        (
            {"structured_outputs": {"structural_tag": '{"triggers": ["<"]}'}},
            "structured_outputs.structural_tag.structures",
        ),
        ({"use_beam_search": True}, "unknown sampling option.*use_beam_search"),
    ],
)
def test_vllm_fields_without_a_counterpart_are_named(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


def test_lora_request_is_refused(llm):
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate("Hello", SamplingParams(max_tokens=1), lora_request=object())


def test_chat_renders_as_transformers(llm, ckpt):
    hf = AutoTokenizer.from_pretrained(ckpt)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The cat sat"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = llm.chat(conv, sp, chat_template_kwargs={"enable_thinking": False}, tools=tools)
    text = hf.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    ids = hf.encode(text, add_special_tokens=False)
    assert out[0].prompt == text and out[0].prompt_token_ids == ids
    assert out[0].outputs[0].token_ids == hc.hf_greedy(ckpt, ids, 4)
    open_turn = [*conv, {"role": "assistant", "content": "It"}]
    two = llm.chat([conv, open_turn], sp, add_generation_prompt=False, continue_final_message=True)
    assert [o.prompt for o in two] == [
        hf.apply_chat_template(c, tokenize=False, continue_final_message=True) for c in (conv, open_turn)
    ]
    assert llm.get_tokenizer().encode("The cat sat", add_special_tokens=False) == hf.encode(
        "The cat sat", add_special_tokens=False
    )
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message"):
        llm.chat(open_turn, sp, continue_final_message=True)


def test_vllm_constructor_arguments(ckpt, tmp_path):
    with LLM(ckpt, enforce_eager=True, engine_process=False) as eager:
        assert eager.config.cuda_graphs is False
    with pytest.raises(ValueError, match="enforce_eager=True and cuda_graphs=True"):
        LLM(ckpt, enforce_eager=True, cuda_graphs=True)
    with pytest.raises(ValueError, match="speculative_config method 'eagle'"):
        LLM(ckpt, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="limit_mm_per_prompt: unknown modality 'audio'"):
        LLM(ckpt, limit_mm_per_prompt={"audio": 1})
    mtp = hc.make(tmp_path / "mtp", TinyModelSpec(layers=4, mtp=True, tokenizer=False, seed=3))
    spec = {"method": "qwen3_next_mtp", "num_speculative_tokens": 2}
    with LLM(mtp, speculative_config=spec, engine_process=False) as llm:
        assert (llm.config.speculative.method, llm.config.speculative.num_tokens) == ("mtp", 2)
