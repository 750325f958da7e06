"""The checkpoint's generation_config.json as default sampling parameters (vLLM's
`--generation-config auto`), `--override-generation-config` over it, and
`--default-chat-template-kwargs`, served by `pdserve up` and read by the OpenAI client: a request
that sets nothing gets the model's top_k 1 (transformers' greedy tokens) and its max_new_tokens as
a cap; a request's own top_k wins; the server's enable_thinking false renders the prompt as
transformers' tokenizer renders it with that switch, unless the request sends its own. With
`--return-tokens-as-token-ids` logprobs name tokens `token_id:N` unless a request says false, and
with `--enable-force-include-usage` a stream that asked for no usage ends with it. The cluster is
started as vLLM's recipes start it: `pdserve serve MODEL` and their flags."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Proc, log_url

CAP = 5  # the checkpoint's max_new_tokens
READY = r"pdserve up: ready at (\S+)"


@pytest.fixture(scope="module")
def model(ckpt, tmp_path_factory):
    from transformers import GenerationConfig

    dst = tmp_path_factory.mktemp("gen-defaults") / "ckpt"
    shutil.copytree(ckpt, dst)
    g = GenerationConfig.from_pretrained(ckpt)
    g.update(do_sample=True, top_k=1, temperature=0.9, max_new_tokens=CAP)
    g.save_pretrained(dst)  # transformers writes the file, as a published checkpoint's
    return str(dst)


def test_defaults_from_the_checkpoint_and_the_server_template_kwargs(model):
    import openai
    from transformers import AutoTokenizer

    msgs = [{"role": "user", "content": "Tell me a story."}]
    tok = AutoTokenizer.from_pretrained(model)
    rendered = {
        t: tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=t, tokenize=False) for t in (0, 1)
    }
    assert rendered[0] != rendered[1]  # the switch changes the prompt: what the server's default decides
    kwargs = '{"enable_thinking": false}'
    # started as `vllm serve MODEL` with a Qwen3.5 recipe's flags is
    recipe = ("--tensor-parallel-size", "1", "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder")
    recipe += ("--enable-auto-tool-choice", "--enable-expert-parallel", "--async-scheduling", "--port", "0")
    recipe += ("--grpc-port", "0")  # serve's --port is the HTTP port, as vLLM's
    switches = (
        "--return-tokens-as-token-ids",
        "--enable-force-include-usage",
        "--default-chat-template-kwargs",
        kwargs,
    )
    up = Proc("serve", model, *recipe, "--dtype", "float32", *switches, ready=READY)
    try:
        url = log_url(up, r"OpenAI-compatible HTTP on (http://\S+/v1)")
        assert up.find(r"default sampling parameters \(--generation-config auto\): (.*top_k 1)", timeout=30)
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as oc:
            m = oc.models.list().data[0].id
            body = {"ignore_eos": True, "return_token_ids": True}

            def chat(**kw):
                extra = {**body, **kw.pop("extra_body", {})}
                r = oc.chat.completions.create(model=m, messages=msgs, extra_body=extra, **kw)
                return r.model_dump()

            plain = chat()  # nothing set: the checkpoint's top_k 1 and cap
            capped = chat(max_tokens=CAP + 3, seed=3)  # more than the cap asked: the cap
            own = chat(max_tokens=CAP, seed=3, temperature=1.0, extra_body={"top_k": -1})  # its own top_k: sampled
            thinking = chat(max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
            named = chat(logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
            texts = chat(logprobs=True, extra_body={"return_tokens_as_token_ids": False})
            stream = list(oc.chat.completions.create(model=m, messages=msgs, stream=True, extra_body=body))
    finally:
        assert up.stop() == 0, up.output()
    prompt = plain["prompt_token_ids"]
    assert tok.decode(prompt) == rendered[0]  # the server's enable_thinking false
    assert tok.decode(thinking["prompt_token_ids"]) == rendered[1]  # the request's own wins
    greedy = hc.hf_greedy(model, prompt, CAP)
    for r in (plain, capped):
        assert r["usage"]["completion_tokens"] == CAP and r["choices"][0]["finish_reason"] == "length"
        assert r["choices"][0]["token_ids"] == greedy
    assert own["choices"][0]["token_ids"] != greedy
    assert [e["token"] for e in named] == [f"token_id:{t}" for t in greedy]
    assert all(a["token"].startswith("token_id:") for e in named for a in e["top_logprobs"])
    text = texts["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in text) == texts["choices"][0]["message"]["content"]
    assert stream[-1].usage is not None and stream[-1].usage.completion_tokens == CAP
