"""Two vLLM request behaviours through `pdserve up` (one prefill + one decode node, disaggregated,
`--max-model-len 64`), on a copy of the tiny checkpoint whose EOS ids hold a visible, non-special
token besides `<|endoftext|>`:

- the text of the token that ended an output as an EOS or a `stop_token_ids` entry is left out
  (its id stays in token_ids) unless `include_stop_str_in_output`, as vLLM's detokenizer does
  (vllm/v1/engine/detokenizer.py, `update(..., stop_terminated)`), for special and non-special
  tokens alike, on completions, chat, Anthropic's Messages and Responses, streamed and whole, and
  over gRPC; the reference is transformers' tokenizer decoding the output ids less the last;
- `truncate_prompt_tokens` keeps the prompt's last N tokens (-1: max_model_len): the output equals
  transformers' greedy continuation of those ids, usage and prompt_token_ids count them, and echo
  with logprobs equals the log-softmax of transformers' logits over them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Up, log_url

CTX = 64  # --max-model-len
PROMPT = "Hello world! How are you"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def eos_x(hf) -> int:
    """A regular (non-special) token with visible text: the copy's second EOS id."""
    return next(t for t in range(3, 600) if (s := hf.decode([t])).isalpha() and len(s) >= 3)


@pytest.fixture(scope="module")
def http_up(ckpt, eos_x, tmp_path_factory):
    """The cluster conftest's `oai` and `model` talk to: on the copy whose EOS ids hold `eos_x`."""
    path = tmp_path_factory.mktemp("visible_eos") / "ckpt"
    shutil.copytree(ckpt, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = [0, eos_x]
    (path / "config.json").write_text(json.dumps(cfg))
    u = Up(
        *("--model", str(path), "--dtype", "float32", "--max-model-len", str(CTX)),
        *("--decode", "1", "--prefill", "1", "--http-port", "0"),
    )
    yield u
    rc = u.stop()
    assert rc == 0, u.output()


@pytest.fixture(scope="module")
def sdk(http_up):
    from client import Client

    with Client(http_up.address, timeout=120) as c:
        c.wait_ready(timeout=60)
        yield c


def _completion(oai, model, stream: bool, **body):
    """(text, token_ids, finish_reason, stop_reason) of a one-choice completion."""
    kw = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0)
    if not stream:
        c = oai.completions.create(**kw, extra_body=dict(return_token_ids=True, **body)).choices[0]
        return c.text, c.model_extra["token_ids"], c.finish_reason, c.model_extra["stop_reason"]
    text, ids, fin, why = "", list[int](), None, None
    for ch in oai.completions.create(**kw, stream=True, extra_body=dict(return_token_ids=True, **body)):
        c = ch.choices[0]
        text += c.text
        ids += c.model_extra.get("token_ids") or []
        fin, why = c.finish_reason or fin, c.model_extra.get("stop_reason", why)
    return text, ids, fin, why


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_token_text_is_left_out_on_completions(oai, model, hf, stream):
    free = oai.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids = free.choices[0].model_extra["token_ids"]
    # a non-special stop token with text, first seen at k > 0
    k = next(i for i in range(1, len(ids)) if hf.decode(ids[i : i + 1]).strip() and ids[i] not in ids[:i])
    stop = ids[k]
    got = _completion(oai, model, stream, stop_token_ids=[stop], ignore_eos=True)
    assert got == (hf.decode(ids[:k]), ids[: k + 1], "stop", stop)
    got = _completion(oai, model, stream, stop_token_ids=[stop], ignore_eos=True, include_stop_str_in_output=True)
    assert got == (hf.decode(ids[: k + 1]), ids[: k + 1], "stop", stop)
    # a special EOS, its text asked for with skip_special_tokens false: left out all the same
    eos = dict(logit_bias={"0": 100}, skip_special_tokens=False)
    assert _completion(oai, model, stream, **eos) == ("", [0], "stop", None)
    text, ids, _, _ = _completion(oai, model, stream, include_stop_str_in_output=True, **eos)
    assert (text, ids) == (hf.decode([0], skip_special_tokens=False), [0])


def test_stop_token_text_over_grpc(sdk, hf, eos_x):
    g = sdk.generate(prompt=PROMPT, max_tokens=8, temperature=0.0, logit_bias={eos_x: 100.0})
    assert (g.text, g.token_ids, g.finish_reason) == ("", [eos_x], "stop")
    g = sdk.generate(
        prompt=PROMPT, max_tokens=8, temperature=0.0, logit_bias={eos_x: 100.0}, include_stop_str_in_output=True
    )
    assert g.text == hf.decode([eos_x])


def test_visible_eos_text_is_left_out_on_chat_messages_and_responses(oai, model, http_up, eos_x):
    import anthropic

    force = {"logit_bias": {str(eos_x): 100}}
    r = oai.chat.completions.create(
        model=model, messages=USER, max_tokens=8, temperature=0.0, extra_body=NO_THINK | force
    )
    assert (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 1)
    chunks = list(
        oai.chat.completions.create(
            model=model, messages=USER, max_tokens=8, temperature=0.0, stream=True, extra_body=NO_THINK | force
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "stop"

    root = log_url(http_up, r"OpenAI-compatible HTTP on (http://\S+)/v1")
    with anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0, timeout=120) as claude:
        kw = dict(model=model, max_tokens=8, messages=USER, thinking={"type": "disabled"}, extra_body=force)
        m = claude.messages.create(**kw)
        assert (m.stop_reason, m.usage.output_tokens) == ("end_turn", 1)
        assert "".join(b.text for b in m.content if b.type == "text") == ""
        with claude.messages.stream(**kw) as s:
            final = s.get_final_message()
        assert "".join(b.text for b in final.content if b.type == "text") == ""

    kw = dict(model=model, input="hi", max_output_tokens=8, extra_body=NO_THINK | force)
    r = oai.responses.create(**kw)
    assert (r.status, r.output_text, r.usage.output_tokens) == ("completed", "", 1)
    done = [e for e in oai.responses.create(stream=True, **kw) if e.type == "response.completed"]
    assert done[0].response.output_text == ""


def _hf_logprobs(ckpt, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hc._hf_model(ckpt)(torch.tensor([ids])).logits[0].float(), -1)


def test_truncate_prompt_tokens_on_completions(oai, model, ckpt, hf):
    prompt = hc.prompts(lens=(20,), seed=11)[0]
    kept = prompt[-8:]
    want = hc.hf_greedy(ckpt, kept, 4)
    body = dict(truncate_prompt_tokens=8, return_token_ids=True, ignore_eos=True)
    r = oai.completions.create(
        model=model, prompt=prompt, max_tokens=4, temperature=0.0, echo=True, logprobs=1, extra_body=body
    )
    c = r.choices[0]
    assert r.usage.prompt_tokens == 8 and c.model_extra["prompt_token_ids"] == kept
    assert c.model_extra["token_ids"] == want
    assert c.text == hf.decode(kept, skip_special_tokens=False) + hf.decode(want)
    ref = _hf_logprobs(ckpt, kept + want)
    lps = c.logprobs.token_logprobs
    assert lps[0] is None and len(lps) == 8 + 4
    assert lps[1:] == pytest.approx([ref[i - 1, t].item() for i, t in enumerate(kept + want) if i], abs=2e-4)
    # vLLM's prompt_logprobs are the kept tokens' too (streamed: on the first chunk)
    chunks = list(
        oai.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=1,
            temperature=0.0,
            stream=True,
            extra_body=dict(body, prompt_logprobs=0),
        )
    )
    plp = chunks[0].choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and [int(next(iter(d))) for d in plp[1:]] == kept[1:]
    # a text prompt is cut after tokenizing
    ids = hf.encode(PROMPT, add_special_tokens=False)
    r = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=1, temperature=0.0, extra_body=dict(body, truncate_prompt_tokens=3)
    )
    assert r.choices[0].model_extra["prompt_token_ids"] == ids[-3:] and r.usage.prompt_tokens == 3
    # shorter than N: as sent; -1: max_model_len (a prompt of exactly that many takes one token)
    r = oai.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0.0, extra_body=dict(body, truncate_prompt_tokens=50)
    )
    assert r.usage.prompt_tokens == 20
    long = hc.prompts(lens=(CTX + 30,), seed=12)[0]
    r = oai.completions.create(
        model=model, prompt=long, max_tokens=1, temperature=0.0, extra_body=dict(body, truncate_prompt_tokens=-1)
    )
    assert r.choices[0].model_extra["prompt_token_ids"] == long[-CTX:]
    assert r.choices[0].model_extra["token_ids"] == hc.hf_greedy(ckpt, long[-CTX:], 1)


def test_truncate_prompt_tokens_on_chat(oai, model, ckpt, hf):
    msgs = [{"role": "user", "content": "Tell me a story about a cat who sails the sea"}]
    text = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    rendered = hf.encode(text, add_special_tokens=False)
    kept = rendered[-6:]
    want = hc.hf_greedy(ckpt, kept, 3)
    r = oai.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=3,
        temperature=0.0,
        extra_body=NO_THINK | dict(truncate_prompt_tokens=6, return_token_ids=True, ignore_eos=True),
    )
    assert len(rendered) > 6 and r.usage.prompt_tokens == 6
    assert r.model_extra["prompt_token_ids"] == kept and r.choices[0].model_extra["token_ids"] == want


@pytest.mark.parametrize(
    "value, says", [(0, "positive"), (-2, "positive"), (CTX + 1, "max_model_len"), ("8", None)], ids=str
)
def test_truncate_prompt_tokens_refusals_name_the_field(oai, model, value, says):
    import openai

    for route in ("completions", "chat"):
        with pytest.raises(openai.BadRequestError) as ei:
            if route == "chat":
                oai.chat.completions.create(
                    model=model, messages=USER, max_tokens=2, extra_body={"truncate_prompt_tokens": value}
                )
            else:
                oai.completions.create(
                    model=model, prompt=PROMPT, max_tokens=2, extra_body={"truncate_prompt_tokens": value}
                )
        assert ei.value.body["param"] == "truncate_prompt_tokens", ei.value.body
        assert says is None or says in ei.value.body["message"]
