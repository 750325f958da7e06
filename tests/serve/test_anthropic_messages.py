"""Anthropic's Messages API (`/v1/messages`) through the official `anthropic` client against
`pdserve up` (one prefill + one decode node, disaggregated; the tiny checkpoint whose template
renders tools and thinking in Qwen3.5's layout). References: transformers' chat template for the
prompt (count_tokens and usage against the equivalent OpenAI messages rendered by
`apply_chat_template`), the completions endpoint's raw text of that prompt for the thinking and
text blocks, jsonschema for a forced tool call's input, and the SDK's own stream accumulator for
the events (the streamed message must equal the whole one)."""

from __future__ import annotations

import base64

import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import log_url

WEATHER = {
    "name": "get_weather",
    "description": "Weather forecast",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
}
OAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER["input_schema"]},
    }
]
SYSTEM = "You help."
USER = [{"role": "user", "content": "Weather in Paris?"}]
OAI_MSGS = [{"role": "system", "content": SYSTEM}, *USER]


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def claude(http_up):
    import anthropic

    root = log_url(http_up, r"OpenAI-compatible HTTP on (http://\S+)/v1")
    with anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _plain(blocks) -> list[dict]:
    """Content blocks as dicts (the stream helper returns its parsed subclasses)."""
    return [b.model_dump(exclude={"parsed_output", "citations"}) for b in blocks]


def _rendered(hf, msgs, **kw) -> list[int]:
    return hf.encode(
        hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw), add_special_tokens=False
    )


@pytest.mark.parametrize("bias", [0, 100], ids=["thinking", "think-closed-first"])
def test_blocks_match_the_prompts_raw_text(claude, oai, model, hf, bias):
    """Thinking on (the template's default): the output opens inside the think block; the text up
    to `</think>` is the thinking block, the rest the text block, as the raw completion splits."""
    close = hf.convert_tokens_to_ids("</think>")
    extra = {"logit_bias": {str(close): bias}, "ignore_eos": True, "temperature": 0.0}
    ids = _rendered(hf, OAI_MSGS)
    raw = oai.completions.create(model=model, prompt=ids, max_tokens=20, extra_body=extra)
    thinking, closed, text = raw.choices[0].text.partition("</think>")
    kw = dict(model=model, system=SYSTEM, messages=USER, max_tokens=20, extra_body=extra)
    m = claude.messages.create(**kw)
    want = [("thinking", thinking.strip("\n"))] if thinking.strip("\n") else []
    want += [("text", text.lstrip("\n").rstrip())] if closed and text.strip() else []
    got = [(b.type, b.thinking if b.type == "thinking" else b.text) for b in m.content]
    assert got == want, raw.choices[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None and m.role == "assistant"
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids) and m.usage.output_tokens == 20
    with claude.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert _plain(streamed.content) == _plain(m.content) and streamed.stop_reason == "max_tokens"
    assert streamed.usage.output_tokens == 20


def test_thinking_switch_and_stop_sequences(claude, model, hf, ckpt):
    """`thinking: disabled` renders the closed think block (transformers' enable_thinking=False);
    the text is transformers' greedy tokens; a stop sequence ends it with stop_reason
    `stop_sequence` naming the string."""
    ids = _rendered(hf, OAI_MSGS, enable_thinking=False)
    text = hf.decode(hc.hf_greedy(ckpt, ids, 12), skip_special_tokens=True)
    kw = dict(model=model, system=SYSTEM, messages=USER, extra_body={"ignore_eos": True, "temperature": 0.0})
    m = claude.messages.create(max_tokens=12, thinking={"type": "disabled"}, **kw)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text.strip()
    stop = text.strip()[3:6]
    assert len(stop) == 3 and stop not in text.strip()[:5]
    s = claude.messages.create(max_tokens=12, thinking={"type": "disabled"}, stop_sequences=[stop], **kw)
    assert (s.stop_reason, s.stop_sequence) == ("stop_sequence", stop)
    assert s.content[0].text == text.strip()[: text.strip().index(stop)].rstrip()
    with claude.messages.stream(max_tokens=12, thinking={"type": "disabled"}, stop_sequences=[stop], **kw) as st:
        f = st.get_final_message()
    assert (f.stop_reason, f.stop_sequence, _plain(f.content)) == ("stop_sequence", stop, _plain(s.content))


def test_a_final_assistant_message_is_continued(claude, model, hf, ckpt):
    """A last assistant message (an agent's prefill, `{"answer":`) is continued, not closed: the
    prompt is transformers' rendering with continue_final_message, counted the same by
    count_tokens, and the text is transformers' greedy continuation of it."""
    prefill = [*USER, {"role": "assistant", "content": '{"answer":'}]
    msgs = [{"role": "system", "content": SYSTEM}, *prefill]
    text = hf.apply_chat_template(
        msgs, continue_final_message=True, add_generation_prompt=False, tokenize=False, enable_thinking=False
    )
    ids = hf.encode(text, add_special_tokens=False)
    assert text.endswith('{"answer":')
    want = hf.decode(hc.hf_greedy(ckpt, ids, 8), skip_special_tokens=True)
    kw = dict(model=model, system=SYSTEM, messages=prefill, thinking={"type": "disabled"})
    m = claude.messages.create(max_tokens=8, extra_body={"ignore_eos": True, "temperature": 0.0}, **kw)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)
    assert claude.messages.count_tokens(**kw).input_tokens == len(ids)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.strip()


def test_forced_tool_call_and_its_history(claude, model, hf):
    """tool_choice `tool` gives one tool_use block whose input follows the schema (stop_reason
    `tool_use`), streamed the same (input_json_delta pieces); sending it back with a tool_result
    renders what transformers renders for the equivalent OpenAI messages (count_tokens)."""
    import jsonschema

    kw = dict(
        model=model,
        system=SYSTEM,
        messages=USER,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=200,
        extra_body={"temperature": 0.0},
        thinking={"type": "disabled"},
    )
    m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"], m
    call = m.content[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with claude.messages.stream(**kw) as s:
        f = s.get_final_message()
    assert f.stop_reason == "tool_use" and [(b.name, b.input) for b in f.content] == [(call.name, call.input)]
    turn = USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]},
    ]
    n = claude.messages.count_tokens(model=model, system=SYSTEM, messages=turn, tools=[WEATHER])
    oai_call = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.input}}
    ref = OAI_MSGS + [
        {"role": "assistant", "content": "", "tool_calls": [oai_call]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    assert n.input_tokens == len(_rendered(hf, ref, tools=OAI_TOOLS))
    thought = [
        {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "Hi"}],
        }
    ]
    n2 = claude.messages.count_tokens(model=model, messages=USER + thought + USER)
    ref2 = [*USER, {"role": "assistant", "content": "Hi", "reasoning_content": "hm"}, *USER]
    assert n2.input_tokens == len(_rendered(hf, ref2))


def test_thinking_budget_tokens(claude, oai, model, hf):
    """thinking.budget_tokens is enforced as chat's thinking_token_budget: the same thinking and
    text as a chat request with that budget, `</think>` made all but impossible (logit_bias)."""
    close = hf.convert_tokens_to_ids("</think>")
    extra = {"logit_bias": {str(close): -100}, "ignore_eos": True, "temperature": 0.0}
    thinking = {"type": "enabled", "budget_tokens": 4}
    m = claude.messages.create(
        model=model, system=SYSTEM, messages=USER, max_tokens=12, extra_body=extra, thinking=thinking
    )
    c = oai.chat.completions.create(
        model=model, messages=OAI_MSGS, max_tokens=12, extra_body=dict(extra, thinking_token_budget=4)
    )
    assert c.usage.completion_tokens_details.reasoning_tokens == 5
    want = [("thinking", c.choices[0].message.model_extra["reasoning_content"]), ("text", c.choices[0].message.content)]
    got = [(b.type, b.thinking if b.type == "thinking" else b.text) for b in m.content]
    assert got == [(k, v) for k, v in want if v], m.content


def test_bad_requests_are_anthropic_errors(claude, model):
    import anthropic

    png = "data:," + base64.b64encode(b"x").decode()
    r = claude._client.post(str(claude.base_url) + "/v1/messages", json={"model": model, "messages": USER})
    assert r.status_code == 400 and r.json()["error"]["message"] == "'max_tokens' is required"  # as the API requires
    cases = [
        (
            dict(messages=USER, max_tokens=4, tools=[{"type": "web_search_20250305", "name": "web_search"}]),
            anthropic.BadRequestError,
            "tools[0].type",
        ),
        (
            dict(messages=[{"role": "system", "content": "x"}], max_tokens=4),
            anthropic.BadRequestError,
            "messages[0].role",
        ),
        (
            dict(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}], max_tokens=4),
            anthropic.BadRequestError,
            "messages[0].content[0]",
        ),
        (
            dict(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
                        ],
                    }
                ],
                max_tokens=4,
            ),
            anthropic.BadRequestError,
            "messages[0].content[0]",
        ),
    ]
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "x"}, shot]}
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    history = [*USER, {"role": "assistant", "content": [call]}, {"role": "user", "content": [result]}]
    cases.append((dict(messages=history, max_tokens=4), anthropic.BadRequestError, "messages[2].content[0].content[1]"))
    for kw, err, where in cases:
        with pytest.raises(err) as e:
            claude.messages.create(**{"model": model, **kw})
        body = e.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert where in body["error"]["message"], body
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="nope", messages=USER, max_tokens=4)
    assert e.value.body["error"]["type"] == "not_found_error"
    assert claude.messages.create(model=model, messages=USER, max_tokens=1).stop_reason == "max_tokens"  # still serving


@pytest.mark.parametrize("api", ["chat", "chat-streamed", "messages"])
def test_a_stop_string_inside_a_call_leaves_no_finished_call(oai, claude, model, api):
    """A stop string that matches inside a forced call's text (the grammar writes `</parameter>`
    after the first value) cuts the call short: the answer ends as at any stop string ("stop" with
    that string; Anthropic's `stop_sequence`), never "tool_calls" / `tool_use`, which tells a
    client to run calls whose arguments here are no JSON (json.loads says so); the call's name and
    arguments so far stay, as with "length"."""
    import json

    stop = "</parameter>"
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "temperature": 0.7, "seed": 3, "top_k": 20}
    if api == "messages":
        forced = dict(tools=[WEATHER], tool_choice={"type": "any"}, stop_sequences=[stop], extra_body=extra)
        m = claude.messages.create(model=model, messages=USER, max_tokens=100, **forced)
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop), m
        assert [b.type for b in m.content] == ["tool_use"] and m.content[0].name == "get_weather"
        return
    kw = dict(model=model, messages=OAI_MSGS, tools=OAI_TOOLS, tool_choice="required", max_tokens=100, stop=[stop])
    if api == "chat":
        c = oai.chat.completions.create(**kw, extra_body=extra).choices[0]
        fin, calls = c.finish_reason, [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()]
        assert (c.model_extra or {}).get("stop_reason") == stop
    else:
        got: dict[int, list[str]] = {}
        fin = None
        for ch in oai.chat.completions.create(stream=True, **kw, extra_body=extra):
            for c in ch.choices:
                for tc in c.delta.tool_calls or ():
                    call = got.setdefault(tc.index, ["", ""])
                    call[0] += tc.function.name or ""
                    call[1] += tc.function.arguments or ""
                fin = c.finish_reason or fin
        calls = [(n, a) for n, a in got.values()]
    assert fin == "stop", (fin, calls)
    ((name, arguments),) = calls
    assert name == "get_weather"
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)
