"""The offline LLM's vLLM-style surface (engine/llm.py, engine/llm_prompts.py,
engine/llm_results.py): vLLM's prompt forms (str, {"prompt"}, {"prompt_token_ids"}, lists mixing
them, a flat list of ints, numpy ids) give transformers' greedy tokens for the token ids the
checkpoint's own tokenizer makes; anything else is a ValueError naming the prompt; the output
carries vLLM's `prompt` and `outputs[0]` (text, token ids, cumulative logprob, {id: Logprob}
per position, finish and stop reasons) checked against a teacher-forced transformers forward;
a closed LLM says so."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HfTokenizer

from engine import LLM, SamplingParams
from engine.outputs import CompletionOutput, Logprob
from engine.tiny_model import TinyModelSpec
from tests.helpers import hybrid_ckpt as hc

N = 6
SP = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("api") / "ckpt", TinyModelSpec(layers=4, seed=7))


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(ckpt, dtype="float32") as llm:
        yield llm


@pytest.fixture(scope="module")
def encode(ckpt):
    tok = HfTokenizer.from_file(f"{ckpt}/tokenizer.json")
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def test_vllm_prompt_forms_give_transformers_tokens(llm, ckpt, encode):
    ids = [5, 17, 300, 42]
    forms = [
        "Hello world",
        {"prompt": "The cat sat"},
        {"prompt_token_ids": ids},
        {"prompt_token_ids": np.array(ids, dtype=np.int64), "prompt": "as text"},
    ]
    want_ids = [encode("Hello world"), encode("The cat sat"), ids, ids]
    outs = llm.generate(forms, SP)
    assert [o.prompt_token_ids for o in outs] == want_ids
    assert [o.output_token_ids for o in outs] == [hc.hf_greedy(ckpt, p, N) for p in want_ids]
    assert [o.prompt for o in outs] == ["Hello world", "The cat sat", None, "as text"]
    one = llm.generate({"prompt_token_ids": ids}, SP)
    assert len(one) == 1 and one[0].output_token_ids == hc.hf_greedy(ckpt, ids, N)
    assert llm.generate({"prompt": "The cat sat"}, SP)[0].output_token_ids == outs[1].output_token_ids


def test_token_id_forms(llm, ckpt):
    ids = [5, 17, 300, 42]
    want = hc.hf_greedy(ckpt, ids, N)
    flat = llm.generate(prompt_token_ids=ids, sampling_params=SP)  # one prompt, as vLLM takes it
    assert [o.output_token_ids for o in flat] == [want]
    arr = llm.generate(prompt_token_ids=np.array([ids, ids]), sampling_params=SP)
    assert [o.output_token_ids for o in arr] == [want, want]
    npints = llm.generate(prompt_token_ids=[[np.int64(t) for t in ids]], sampling_params=SP)
    assert npints[0].output_token_ids == want and npints[0].prompt is None


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(prompts=[{"prompt_ids": [1]}]), r"prompt 0: unknown key\(s\) prompt_ids"),
        (dict(prompts=["hi", 7]), r"prompt 1: expected a str, \{'prompt': str\}"),
        (dict(prompts=["hi", [1, 2]]), r"prompt 1: expected a str, .*got list"),
        (dict(prompts=[{"prompt": 3}]), r"prompt 0: 'prompt' must be a str"),
        (dict(prompts=[{}]), r"prompt 0: expected a str"),
        (dict(prompts=[{"prompt_token_ids": "abc"}]), r"prompt 0: expected a list of token ids"),
        (
            dict(prompts=[{"prompt_token_ids": [1, 2.5]}]),
            r"prompt 0: token ids must be integers \(got 2.5 at position 1\)",
        ),
        (dict(prompt_token_ids=[[1, 2], 3]), r"prompt 1: expected a list of token ids \(got int\)"),
        (dict(prompt_token_ids={"prompt_token_ids": [1]}), r"prompt_token_ids must be a list of token-id lists"),
        (dict(prompts=5), r"prompts must be a str"),
        (dict(), "give exactly one of"),
    ],
)
def test_bad_prompt_forms_name_the_prompt(llm, kw, words):
    with pytest.raises(ValueError, match=words):
        llm.generate(sampling_params=SP, **kw)


def test_numpy_ids_out_of_range_are_shown_as_ints(llm):
    with pytest.raises(ValueError, match=r"prompt 0: prompt token id\(s\) \[5000\] out of range"):
        llm.generate(prompt_token_ids=[np.array([1, 5000])], sampling_params=SP)


def _hf_logprobs(ckpt, prompt, tokens):
    with torch.inference_mode():
        logits = hc._hf_model(ckpt)(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), -1)


def test_completion_output_matches_transformers(llm, ckpt, encode):
    prompt = "Hello world"
    sp = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=3)
    out = llm.generate(prompt, sp)[0]
    ids = encode(prompt)
    want = hc.hf_greedy(ckpt, ids, N)
    assert len(out.outputs) == 1
    c = out.outputs[0]
    assert isinstance(c, CompletionOutput) and c.index == 0
    assert c.token_ids == want and c.finish_reason == "length" and c.stop_reason is None
    assert c.text == HfTokenizer.from_file(f"{ckpt}/tokenizer.json").decode(want)
    lp = _hf_logprobs(ckpt, ids, want)
    chosen = lp.gather(1, torch.tensor(want)[:, None])[:, 0]
    assert abs(c.cumulative_logprob - chosen.sum().item()) < 1e-3
    assert len(c.logprobs) == N
    for k, pos in enumerate(c.logprobs):
        top = lp[k].topk(3)
        assert list(pos)[0] == want[k]  # the chosen token first
        assert set(pos) == {want[k], *top.indices.tolist()}
        for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert isinstance(pos[t], Logprob) and pos[t].rank == r and abs(pos[t].logprob - v) < 1e-3
        assert pos[want[k]].decoded_token == HfTokenizer.from_file(f"{ckpt}/tokenizer.json").decode(
            [want[k]], skip_special_tokens=False
        )
    # the existing fields stay
    assert out.output_token_ids == want and out.finish_reason == "length" and len(out.logprobs) == N


def test_stop_reason_is_the_stop_token(llm, ckpt):
    ids = [5, 17, 300, 42]
    want = hc.hf_greedy(ckpt, ids, N)
    stop = want[3]
    k = want.index(stop)  # the first time it comes
    sp = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    c = llm.generate({"prompt_token_ids": ids}, sp)[0].outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == (want[: k + 1], "stop", stop)
    assert c.cumulative_logprob is None and c.logprobs is None


def test_closed_llm_says_so(ckpt):
    llm = LLM(ckpt, dtype="float32")
    llm.close()
    for call in (lambda: llm.generate("hi", SP), lambda: llm.compute_logits([[1, 2]]), llm.capacity):
        with pytest.raises(RuntimeError, match="the LLM is closed"):
            call()
    llm.close()  # a second close is quiet


@pytest.mark.parametrize("alias,name", [("half", "float16"), ("bf16", "bfloat16"), ("float", "float32")])
def test_vllm_dtype_names(ckpt, alias, name):
    """`LLM(dtype=...)` takes vLLM's short names as the command line does."""
    with LLM(ckpt, dtype=alias, engine_process=False) as llm:
        assert llm.config.model.dtype == getattr(torch, name)


@pytest.mark.parametrize(
    "kw,name",
    [({"fp8_experts": "yes"}, "fp8_experts"), ({"fp8_dense": "on"}, "fp8_dense"), ({"dtype": "fp8"}, "dtype")],
)
def test_an_option_outside_its_choices_is_refused(ckpt, kw, name):
    """As the command line's choices refuse it (an unknown value was taken as its default)."""
    with pytest.raises(ValueError, match=f"{name} must be one of"):
        LLM(ckpt, engine_process=False, **kw)
