"""What agents send, through the official `openai` client against `pdserve up` (one prefill +
one decode node, disaggregated) on the tiny checkpoint whose template renders tools and thinking
in Qwen3.5's layout: the chat template's switches reach the prompt (token counts equal
transformers' rendering), reasoning and content split streamed and not (the reference: the same
prompt's raw text from the completions endpoint, split at `</think>` here), tool_choice auto
answers, an image part is refused naming it (a text-only checkpoint), and tool_choice required / named give calls whose
arguments validate against the tool's schema (jsonschema), streamed the same, finish_reason
"tool_calls". The cluster runs with n-gram drafts on (`--num-speculative-tokens 3`): the call
format repeats itself, so drafts are proposed inside calls and verified under the grammar's mask."""

from __future__ import annotations

import json

import pytest

from tests.helpers.serve_harness import Up, decode_stats, log_url, nodes

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]},
    },
}
TOOLS = [WEATHER, TIME]
DRAFTS = ("--num-speculative-tokens", "3")
MESSAGES = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}]
GREEDY = dict(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def http_up(ckpt):
    u = Up("--model", ckpt, "--dtype", "float32", "--decode", "1", "--prefill", "1", "--http-port", "0", *DRAFTS)
    yield u
    rc = u.stop()
    assert rc == 0, u.output()


@pytest.fixture(scope="module")
def base_url_agents(http_up):
    return log_url(http_up, r"OpenAI-compatible HTTP on (http://\S+/v1)")


def _stream(oai, **kw) -> tuple[dict, str | None]:
    """A streamed chat answer assembled as a client does: (message fields, finish_reason)."""
    msg: dict = {"content": "", "reasoning_content": "", "calls": {}}
    fin = None
    for ch in oai.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            d = c.delta
            msg["content"] += d.content or ""
            msg["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or ():
                call = msg["calls"].setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            fin = c.finish_reason or fin
    return msg, fin


def test_template_switches_reach_the_prompt(oai, model, hf):
    for kw in ({}, {"enable_thinking": False}):
        r = oai.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, extra_body={"chat_template_kwargs": kw}, **GREEDY
        )
        want = hf.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kw)
        assert r.usage.prompt_tokens == len(hf.encode(want, add_special_tokens=False)), kw
    on = oai.chat.completions.create(model=model, messages=MESSAGES, **GREEDY).usage.prompt_tokens
    off = oai.chat.completions.create(
        model=model, messages=MESSAGES, extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **GREEDY
    ).usage.prompt_tokens
    closed = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert closed.endswith("<think>\n\n</think>\n\n")
    assert off == len(hf.encode(closed, add_special_tokens=False)) > on
    # Qwen's own API takes the switch at the top level; chat_template_kwargs' wins where both are sent
    top = oai.chat.completions.create(model=model, messages=MESSAGES, extra_body={"enable_thinking": False}, **GREEDY)
    both = {"enable_thinking": False, "chat_template_kwargs": {"enable_thinking": True}}
    assert top.usage.prompt_tokens == off
    # OpenAI's reasoning_effort (and the Responses API's reasoning.effort): "none" is thinking off
    for effort, want in (("none", off), ("high", on)):
        r = oai.chat.completions.create(model=model, messages=MESSAGES, reasoning_effort=effort, **GREEDY)
        assert r.usage.prompt_tokens == want, effort
        r = oai.responses.create(model=model, input=MESSAGES, reasoning={"effort": effort}, max_output_tokens=2)
        assert r.usage.input_tokens == want, effort
    assert (
        oai.chat.completions.create(model=model, messages=MESSAGES, extra_body=both, **GREEDY).usage.prompt_tokens == on
    )


@pytest.mark.parametrize("bias", [0, 0.5, 100], ids=["no-close", "close-later", "close-first"])
def test_reasoning_and_content_split(oai, model, hf, bias):
    close = hf.convert_tokens_to_ids("</think>")
    extra = {"logit_bias": {str(close): bias}, "ignore_eos": True}
    kw = dict(GREEDY, max_tokens=24)
    prompt = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ref = oai.completions.create(model=model, prompt=prompt, extra_body=extra, logprobs=0, **kw).choices[0]
    raw, tokens = ref.text, ref.logprobs.tokens
    reasoning, closed, content = raw.partition("</think>")
    thinking = tokens.index("</think>") + 1 if closed else len(tokens)  # tokens up to and with </think>
    want = {"reasoning_content": reasoning.strip("\n") or None, "content": content.lstrip("\n").rstrip()}
    r = oai.chat.completions.create(model=model, messages=MESSAGES, extra_body=extra, **kw)
    got = r.choices[0].message
    assert {"reasoning_content": got.model_extra["reasoning_content"], "content": got.content} == want, raw
    assert r.usage.completion_tokens_details.reasoning_tokens == thinking
    streamed, fin = _stream(oai, model=model, messages=MESSAGES, extra_body=extra, **kw)
    assert streamed["reasoning_content"] == (want["reasoning_content"] or "")
    assert streamed["content"] == want["content"] and fin == "length"


@pytest.mark.parametrize("budget", [0, 5])
def test_thinking_token_budget(oai, model, hf, budget):
    """vLLM's thinking_token_budget: with `</think>` made all but impossible (logit_bias -100),
    thinking still stops after `budget` tokens (without a budget it runs to max_tokens); the
    answer is the raw completion of the prompt + those tokens + `</think>` (the completions
    endpoint: the answer is not masked); with a JSON schema too, the answer follows the schema.
    (The thinking tokens are the model's most likely text tokens: the tiny model also ranks ids
    past its tokenizer's vocabulary, which are no text.)"""
    import jsonschema

    close = hf.convert_tokens_to_ids("</think>")
    extra = {"logit_bias": {str(close): -100}, "ignore_eos": True, "return_token_ids": True}
    kw = dict(model=model, messages=MESSAGES, temperature=0.0, max_tokens=12)
    free = oai.chat.completions.create(extra_body=extra, **kw)
    assert free.usage.completion_tokens_details.reasoning_tokens == 12
    r = oai.chat.completions.create(extra_body=dict(extra, thinking_token_budget=budget), **kw)
    ids = r.choices[0].token_ids  # type: ignore[attr-defined]
    assert close not in ids[:budget] and ids[budget] == close
    assert r.usage.completion_tokens_details.reasoning_tokens == budget + 1
    assert (r.choices[0].message.model_extra["reasoning_content"] or "") == hf.decode(ids[:budget]).strip("\n")
    head = r.prompt_token_ids + ids[: budget + 1]  # type: ignore[attr-defined]
    rest = oai.completions.create(model=model, prompt=head, temperature=0.0, max_tokens=11 - budget, extra_body=extra)
    assert rest.choices[0].token_ids == ids[budget + 1 :]  # type: ignore[attr-defined]
    assert r.choices[0].message.content == rest.choices[0].text.lstrip("\n").rstrip()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": dict(schema, additionalProperties=False)}}
    bias = {"thinking_token_budget": budget, "logit_bias": extra["logit_bias"]}
    j = oai.chat.completions.create(response_format=fmt, extra_body=bias, **dict(kw, max_tokens=40))
    assert j.usage.completion_tokens_details.reasoning_tokens == budget + 1
    jsonschema.validate(json.loads(j.choices[0].message.content), schema)


def test_tool_choice_auto_answers(oai, model):
    r = oai.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="auto", **GREEDY)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert r.choices[0].message.role == "assistant"


def test_image_part_is_refused_naming_it(oai, model):
    import openai

    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}], **GREEDY)
    assert e.value.body["param"] == "messages[0].content[1]"  # a text-only checkpoint
    assert e.value.body["message"] == "messages[0].content[1]: this model does not take images"


def test_tool_history_renders(oai, model, hf):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"utc": true}'}}
    msgs = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    r = oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS, **GREEDY)
    ref = json.loads(json.dumps(msgs))
    ref[2]["tool_calls"][0]["function"]["arguments"] = {"utc": True}
    want = hf.apply_chat_template(ref, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(hf.encode(want, add_special_tokens=False))


@pytest.mark.parametrize(
    "choice,thinking",
    [("required", False), ("get_weather", False), ("get_time", False), ("required", True)],
    ids=["required", "named-weather", "named-time", "required-after-think"],
)
def test_required_and_named_calls_follow_the_schema(http_up, oai, model, hf, choice, thinking):
    import jsonschema

    decode = next(n.node.address for n in nodes(http_up.address) if n.node.kind == 2)  # NODE_KIND_DECODE

    def drafts() -> int:
        return sum(decode_stats(decode).speculation.drafts_per_position)

    named = choice != "required"
    tool_choice = {"type": "function", "function": {"name": choice}} if named else "required"
    extra: dict = {"chat_template_kwargs": {"enable_thinking": thinking}}
    if thinking:  # the model closes its think block at once; the calls are constrained after it
        extra["logit_bias"] = {str(hf.convert_tokens_to_ids("</think>")): 100}
    kw = dict(
        model=model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0.0,
        max_tokens=200,
        extra_body=extra,
    )
    before = drafts()
    r = oai.chat.completions.create(parallel_tool_calls=False, **kw)
    if not thinking:  # drafts were proposed inside the constrained output (logit_bias turns them off)
        assert drafts() > before
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert len(c.message.tool_calls) == 1 and c.message.content is None
    call = c.message.tool_calls[0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert call.function.name in schemas and (not named or call.function.name == choice)
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    streamed, fin = _stream(oai, parallel_tool_calls=False, **kw)
    assert fin == "tool_calls"
    assert [(s["name"], s["arguments"]) for s in streamed["calls"].values()] == [
        (call.function.name, call.function.arguments)
    ]
    assert streamed["calls"][0]["id"].startswith("call_")


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "after-think"])
def test_response_format_json(oai, model, hf, thinking):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    extra: dict = {"chat_template_kwargs": {"enable_thinking": thinking}}
    if thinking:
        extra["logit_bias"] = {str(hf.convert_tokens_to_ids("</think>")): 100}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    kw = dict(model=model, messages=MESSAGES, temperature=0.0, max_tokens=60, extra_body=extra)
    r = oai.chat.completions.create(response_format=fmt, **kw)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    streamed, fin = _stream(oai, response_format=fmt, **kw)
    assert streamed["content"] == r.choices[0].message.content and fin == "stop"
    obj = oai.chat.completions.create(response_format={"type": "json_object"}, **kw).choices[0].message.content
    assert isinstance(json.loads(obj), dict)


def test_other_engines_structured_output_fields_constrain(oai, model, hf):
    """vLLM's `structured_outputs` and `guided_*` fields, SGLang's `regex`, and `response_format`
    on completions: each constrains the output (a random model's free text matches none of them);
    a GBNF grammar is taken as a grammar."""
    import re

    import jsonschema

    kw = dict(model=model, temperature=0.0, max_tokens=24)
    prompt = "Answer:"
    choices = ["yes", "no", "maybe"]

    def text(**extra) -> str:
        return oai.completions.create(prompt=prompt, extra_body=extra, **kw).choices[0].text

    free = text()
    assert free not in choices and not re.fullmatch(r"[0-9]{3}-[a-c]{2}", free)
    assert text(structured_outputs={"choice": choices}) in choices
    assert text(guided_choice=choices) in choices
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", text(guided_regex=r"[0-9]{3}-[a-c]{2}"))
    assert re.fullmatch(r"[0-9]{2}:[xy]{2}", text(regex=r"[0-9]{2}:[xy]{2}"))
    gbnf = 'root ::= "id-" digit digit digit\ndigit ::= [0-9]'
    assert re.fullmatch(r"id-[0-9]{3}", text(structured_outputs={"grammar": gbnf}))
    assert re.fullmatch(r"id-[0-9]{3}", text(guided_grammar='start: "id-" D D D\nD: /[0-9]/'))
    schema = {
        "type": "object",
        "properties": {"k": {"type": "integer"}},
        "required": ["k"],
        "additionalProperties": False,
    }
    jsonschema.validate(json.loads(text(guided_json=schema)), schema)
    rf = {"response_format": {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}}
    r = oai.completions.create(prompt=prompt, extra_body=rf, **kw).choices[0]
    assert r.finish_reason == "stop"
    jsonschema.validate(json.loads(r.text), schema)
    # chat, the think block left open: the reasoning is free, the answer one of the choices
    bias = {str(hf.convert_tokens_to_ids("</think>")): 100}
    m = oai.chat.completions.create(
        messages=MESSAGES,
        extra_body={"guided_choice": choices, "chat_template_kwargs": {"enable_thinking": True}, "logit_bias": bias},
        **kw,
    ).choices[0]
    assert m.message.content in choices and m.finish_reason == "stop"


def test_token_ids_stop_strings_and_special_tokens_as_vllm_returns_them(oai, model, hf):
    """vLLM's output extensions: `return_token_ids` (the prompt's ids against transformers'
    tokenization and chat template, the output's decoding to the text; streamed the same),
    `return_tokens_as_token_ids`, `include_stop_str_in_output` (against the free output cut by
    hand) and `skip_special_tokens: false` (the text of the output's ids as transformers decodes
    them, special tokens kept)."""
    kw = dict(model=model, temperature=0.0, max_tokens=16)
    prompt = "Once upon a time"
    r = oai.completions.create(prompt=prompt, extra_body={"return_token_ids": True}, **kw)
    c = r.choices[0].model_extra
    assert c["prompt_token_ids"] == hf.encode(prompt, add_special_tokens=False)
    assert len(c["token_ids"]) == r.usage.completion_tokens
    assert hf.decode(c["token_ids"], skip_special_tokens=True) == r.choices[0].text
    plain = oai.completions.create(prompt=prompt, **kw).choices[0]
    assert "token_ids" not in (plain.model_extra or {}) and plain.text == r.choices[0].text
    got: dict = {"prompt": None, "ids": [], "tokens": []}
    for ch in oai.completions.create(
        prompt=prompt,
        stream=True,
        logprobs=0,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
        **kw,
    ):
        for x in ch.choices:
            e = x.model_extra or {}
            got["prompt"] = got["prompt"] or e.get("prompt_token_ids")
            got["ids"] += e.get("token_ids") or []
            got["tokens"] += x.logprobs.tokens if x.logprobs else []
    assert got["prompt"] == c["prompt_token_ids"] and got["ids"] == c["token_ids"]
    assert got["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]

    messages = [{"role": "user", "content": "Hi there"}]
    tk = {"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True}
    ref = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, enable_thinking=False)
    ref = list(ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref)
    cr = oai.chat.completions.create(messages=messages, extra_body=tk, **kw)
    assert cr.model_extra["prompt_token_ids"] == ref
    ids = cr.choices[0].model_extra["token_ids"]
    assert hf.decode(ids, skip_special_tokens=True) == cr.choices[0].message.content
    first, streamed = None, []
    for ch in oai.chat.completions.create(messages=messages, stream=True, extra_body=tk, **kw):
        first = first if first is not None else (ch.model_extra or {}).get("prompt_token_ids")
        for x in ch.choices:
            streamed += (x.model_extra or {}).get("token_ids") or []
    assert first == ref and streamed == ids

    free = plain.text
    stop = free[6:9]
    assert stop.strip(), free
    at = free.find(stop)
    cut = oai.completions.create(prompt=prompt, stop=[stop], **kw).choices[0]
    kept = oai.completions.create(prompt=prompt, stop=[stop], extra_body={"include_stop_str_in_output": True}, **kw)
    assert (cut.text, cut.finish_reason) == (free[:at], "stop")
    assert (kept.choices[0].text, kept.choices[0].finish_reason) == (free[: at + len(stop)], "stop")

    end = hf.convert_tokens_to_ids("<|im_end|>")
    assert hf.decode([end], skip_special_tokens=True) == "" and hf.decode([end]) == "<|im_end|>"  # special
    sp = dict(
        kw, max_tokens=3, extra_body={"logit_bias": {str(end): 100}, "ignore_eos": True, "return_token_ids": True}
    )
    skipped = oai.completions.create(prompt=prompt, **sp).choices[0]
    sp["extra_body"] = dict(sp["extra_body"], skip_special_tokens=False)
    shown = oai.completions.create(prompt=prompt, **sp).choices[0]
    ids = shown.model_extra["token_ids"]
    assert end in ids and skipped.model_extra["token_ids"] == ids
    assert skipped.text == hf.decode(ids, skip_special_tokens=True) != shown.text
    assert shown.text == hf.decode(ids, skip_special_tokens=False)


def test_bad_agent_inputs_are_400s(oai, model, base_url_agents):
    """Malformed tools, tool choices, formats, messages and Responses items: a 400 each, never a
    500, and the server keeps answering."""
    import urllib.error
    import urllib.request

    user = [{"role": "user", "content": "x"}]
    fn = {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}
    bodies = [
        ("chat/completions", {"messages": user, "tools": "x"}),
        ("chat/completions", {"messages": user, "tools": [1]}),
        ("chat/completions", {"messages": user, "tools": [{"type": "function", "function": {"name": 3}}]}),
        ("chat/completions", {"messages": user, "tools": [{"type": "function", "function": dict(fn, parameters=[])}]}),
        (
            "chat/completions",
            {
                "messages": user,
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"properties": {"a": {"type": "string", "maxLength": {}}}, "required": 5},
                        },
                    }
                ],
                "tool_choice": "required",
            },
        ),
        (
            "chat/completions",
            {
                "messages": user,
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"properties": {"a": {"type": "bogus"}}}},
                    }
                ],
                "tool_choice": "required",
            },
        ),
        ("chat/completions", {"messages": user, "tool_choice": {"type": "function"}}),
        ("chat/completions", {"messages": user, "tool_choice": 7}),
        (
            "chat/completions",
            {"messages": user, "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
        ),
        (
            "chat/completions",
            {
                "messages": user,
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}},
            },
        ),
        ("chat/completions", {"messages": user, "response_format": "json"}),
        ("chat/completions", {"messages": user, "structured_outputs": {"choice": ["a"], "regex": "a"}}),
        ("chat/completions", {"messages": user, "structured_outputs": {"structural_tag": "x"}}),
        ("chat/completions", {"messages": user, "guided_choice": []}),
        ("chat/completions", {"messages": user, "guided_json": {}, "response_format": {"type": "json_object"}}),
        ("completions", {"prompt": "x", "guided_regex": "("}),
        ("completions", {"prompt": "x", "guided_grammar": "root ::= ("}),
        ("completions", {"prompt": "x", "structured_outputs": {"json": "{not json"}}),
        ("completions", {"prompt": "x", "use_beam_search": True}),
        ("completions", {"prompt": "x", "allowed_token_ids": [1, 2]}),
        ("chat/completions", {"messages": user, "bad_words": ["x"]}),
        ("completions", {"prompt": "x", "prompt_logprobs": 21}),
        ("chat/completions", {"messages": user, "prompt_logprobs": 1, "stream": True}),
        ("completions", {"prompt": "x", "truncate_prompt_tokens": 0}),
        ("chat/completions", {"messages": user, "chat_template_kwargs": [1]}),
        ("chat/completions", {"messages": user, "chat_template": "{{ messages[0].content }}"}),
        ("chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]}),
        ("chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{"}}]}]}),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"text": 1}]}]}),
        ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
        ("chat/completions", {"messages": user, "continue_final_message": True}),
        ("responses", {"input": [{"type": "function_call"}]}),
        ("responses", {"input": [{"type": "mystery"}]}),
        ("responses", {"input": [{"role": "user", "content": 5}]}),
        ("responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}),
        ("responses", {"input": "x", "tools": [{"type": "web_search"}]}),
        ("responses", {"input": "x", "text": {"format": {"type": "yaml"}}}),
        ("responses", {"input": "x", "conversation": "c1"}),
    ]
    for route, body in bodies:
        req = urllib.request.Request(
            f"{base_url_agents}/{route}",
            json.dumps(dict(body, model=model, max_tokens=2)).encode(),
            {"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        err = json.loads(e.value.read())["error"]
        assert e.value.code == 400, (route, body, err)
        assert err["message"], (route, body)
    r = oai.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    assert r.choices[0].finish_reason == "length"
