"""`POST /v1/responses` through the official `openai` client against `pdserve up`
(1 prefill + 1 decode node): its answers equal the chat completion of the same conversation
(reasoning item = reasoning_content, message = content, function_call = tool call), streamed
events assemble to the same items, function_call / function_call_output input items render as
transformers renders the equivalent chat messages, `tool_choice` required gives a call valid
under the schema, and an unknown previous_response_id and image parts are 400s naming them; custom tools
(chat and Responses) give calls whose input is in the tool's grammar (checked with `re`), streamed
the same, and a custom call sent back renders as transformers renders the equivalent function call;
tool_choice auto with a strict tool gives calls whose arguments validate; allowed_tools limits the calls;
reasoning sent back only as encrypted_content renders as the reasoning it carried; a stored response
continued by previous_response_id renders as the whole conversation sent as input, and retrieve,
delete and input_items see what was stored."""

from __future__ import annotations

import json

import pytest

TOOL = {
    "type": "function",
    "name": "get_time",
    "description": "The time",
    "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]},
}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
BIAS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


def _plain(items) -> list[dict]:
    """Output items without their generated ids."""
    out = []
    for it in items:
        d = it if isinstance(it, dict) else it.model_dump(exclude_none=True)
        out.append({k: v for k, v in d.items() if k not in ("id", "call_id")})
    return out


def _streamed(oai, **kw) -> tuple[list[dict], object, list[str]]:
    """(items from output_item.done events, the final response, event types in order)."""
    items, final, kinds, seq = [], None, [], []
    for e in oai.responses.create(stream=True, **kw):
        kinds.append(e.type)
        seq.append(e.sequence_number)
        if e.type == "response.output_item.done":
            items.append(e.item)
        if e.type in ("response.completed", "response.incomplete"):
            final = e.response
    assert seq == list(range(len(seq)))
    return items, final, kinds


@pytest.mark.parametrize("close_bias", [0.0, 0.5], ids=["all-reasoning", "reasoning-then-content"])
def test_answer_equals_the_chat_completion(oai, model, hf, close_bias):
    close = hf.convert_tokens_to_ids("</think>")
    extra = dict(BIAS, logit_bias={str(close): close_bias})
    kw = dict(model=model, instructions="Be brief.", input="Say something.", temperature=0.0, max_output_tokens=24)
    r = oai.responses.create(extra_body=extra, **kw)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    chat = oai.chat.completions.create(model=model, messages=msgs, temperature=0.0, max_tokens=24, extra_body=extra)
    m = chat.choices[0].message
    want = []
    if m.model_extra["reasoning_content"]:
        want.append({"type": "reasoning", "text": m.model_extra["reasoning_content"]})
    if m.content:
        want.append({"type": "message", "text": m.content})
    got = [{"type": it.type, "text": it.content[0].text} for it in r.output]
    assert got == want
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 24
    assert r.usage.output_tokens_details.reasoning_tokens == chat.usage.completion_tokens_details.reasoning_tokens
    items, final, kinds = _streamed(oai, extra_body=extra, **kw)
    assert _plain(items) == _plain(r.output) == _plain(final.output)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"


def test_function_call_items_render_as_chat_messages(oai, model, hf):
    items = [
        {"role": "user", "content": "Time?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"utc": true}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
    ]
    r = oai.responses.create(model=model, input=items, tools=[TOOL], temperature=0.0, max_output_tokens=2)
    msgs = [
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Ask.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"utc": True}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    want = hf.apply_chat_template(msgs, tools=[CHAT_TOOL], add_generation_prompt=True, tokenize=False)
    assert "<think>\nAsk.\n</think>" in want
    assert r.usage.input_tokens == len(hf.encode(want, add_special_tokens=False))


def test_required_tool_choice_gives_a_valid_call(oai, model):
    import jsonschema

    kw = dict(
        model=model,
        input="Time?",
        tools=[TOOL],
        tool_choice="required",
        temperature=0.0,
        max_output_tokens=100,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    r = oai.responses.create(**kw)
    calls = [it for it in r.output if it.type == "function_call"]
    assert r.status == "completed" and len(calls) >= 1
    for c in calls:
        assert c.name == "get_time" and c.call_id.startswith("call_")
        jsonschema.validate(json.loads(c.arguments), TOOL["parameters"])
    items, final, kinds = _streamed(oai, **kw)
    assert _plain(items) == _plain(r.output) and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds


def test_refusals_name_the_parameter(oai, model):
    import openai

    for kw, param in (
        (dict(input="x", previous_response_id="resp_1"), "previous_response_id"),
        (
            dict(
                input=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "x"},
                            {"type": "input_image", "image_url": "data:,"},
                        ],
                    }
                ]
            ),
            "input[0].content[1]",  # a text-only checkpoint: "this model does not take images"
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model=model, max_output_tokens=2, **kw)
        assert e.value.body["param"] == param


# ---- custom tools (router/custom_tools.py): input text in the tool's own grammar ----------------
PATCH_RE = r"(add|del) [a-z]{1,8}\.py"  # the language of both grammars below, checked with `re`
LARK = 'start: op " " name ".py"\nop: "add" | "del"\nname: /[a-z]{1,8}/'
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_custom_tool_call_on_chat_follows_its_grammar(oai, model, sampled):
    import re

    tool = {
        "type": "custom",
        "custom": {
            "name": "apply_patch",
            "description": "Edit files",
            "format": {"type": "grammar", "grammar": {"syntax": "regex", "definition": PATCH_RE}},
        },
    }
    sampling = dict(temperature=1.0, top_p=0.95, seed=7) if sampled else dict(temperature=0.0)
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "Patch it"}],
        tools=[tool, CHAT_TOOL],
        tool_choice={"type": "custom", "custom": {"name": "apply_patch"}},
        max_tokens=200,
        extra_body=NO_THINK,
        **sampling,
    )
    c = oai.chat.completions.create(**kw).choices[0]
    (call,) = c.message.tool_calls
    assert c.finish_reason == "tool_calls" and call.type == "custom" and call.custom.name == "apply_patch"
    assert re.fullmatch(PATCH_RE, call.custom.input), call.custom.input
    pieces, fin = {}, None
    for ch in oai.chat.completions.create(stream=True, **kw):
        for ci in ch.choices:
            for tc in ci.delta.tool_calls or ():
                part = (tc.model_extra or {})["custom"]
                got = pieces.setdefault(tc.index, {"name": "", "input": ""})
                got["name"] += part.get("name", "")
                got["input"] += part.get("input", "")
            fin = ci.finish_reason or fin
    assert fin == "tool_calls" and pieces == {0: {"name": "apply_patch", "input": call.custom.input}}


def test_custom_tool_call_items(oai, model, hf):
    import re

    tool = {
        "type": "custom",
        "name": "apply_patch",
        "description": "Edit files",
        "format": {"type": "grammar", "syntax": "lark", "definition": LARK},
    }
    kw = dict(
        model=model,
        input="Patch it",
        tools=[tool, TOOL],
        tool_choice={"type": "custom", "name": "apply_patch"},
        temperature=0.0,
        max_output_tokens=200,
        extra_body=NO_THINK,
    )
    r = oai.responses.create(**kw)
    (call,) = [it for it in r.output if it.type == "custom_tool_call"]
    assert call.name == "apply_patch" and re.fullmatch(PATCH_RE, call.input), call.input
    items, final, kinds = _streamed(oai, **kw)
    assert _plain(items) == _plain(r.output) and kinds[-1] == "response.completed"
    assert {"response.custom_tool_call_input.delta", "response.custom_tool_call_input.done"} <= set(kinds)
    # the call and its output sent back render as the template renders the equivalent function call
    history = [
        {"role": "user", "content": "Patch it"},
        {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch", "input": call.input},
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": "done"},
    ]
    r2 = oai.responses.create(model=model, input=history, tools=[tool], temperature=0.0, max_output_tokens=2)
    fn = {"name": "apply_patch", "arguments": {"input": call.input}}
    msgs = [
        {"role": "user", "content": "Patch it"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": fn}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    note = f"\n\nThe input is text of this lark grammar:\n{LARK}"
    params = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
    as_fn = {
        "type": "function",
        "function": {"name": "apply_patch", "description": "Edit files" + note, "parameters": params},
    }
    want = hf.apply_chat_template(msgs, tools=[as_fn], add_generation_prompt=True, tokenize=False)
    assert r2.usage.input_tokens == len(hf.encode(want, add_special_tokens=False))


def test_auto_with_a_strict_tool_gives_calls_that_follow_the_schema(oai, model, hf):
    """tool_choice auto with a `strict: true` tool: text, then calls whose arguments validate (the
    random model is pushed towards `<tool_call>` by a logit bias; sampled, several seeds)."""
    import jsonschema

    strict = {"type": "function", "function": dict(CHAT_TOOL["function"], strict=True)}
    bias = {str(hf.convert_tokens_to_ids("<tool_call>")): 6}
    calls = 0
    for seed in range(4):
        c = oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Time?"}],
            tools=[strict],
            temperature=1.0,
            seed=seed,
            max_tokens=200,
            logit_bias=bias,
            extra_body=NO_THINK,
        ).choices[0]
        for call in c.message.tool_calls or ():
            calls += 1
            assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), TOOL["parameters"])
        assert c.finish_reason in ("tool_calls", "length", "stop"), c
    assert calls


def test_allowed_tools_limit_the_calls(oai, model):
    """Responses' `allowed_tools` (flat): both tools are offered, the calls name the allowed one."""
    import jsonschema

    other = {"type": "function", "name": "noop", "parameters": {"type": "object", "properties": {}}}
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    for seed in range(3):
        r = oai.responses.create(
            model=model,
            input="Time?",
            tools=[other, TOOL],
            tool_choice=choice,
            temperature=1.0,
            extra_body={**NO_THINK, "seed": seed},
            max_output_tokens=200,
        )
        calls = [it for it in r.output if it.type == "function_call"]
        assert calls and all(c.name == "get_time" for c in calls), r.output
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), TOOL["parameters"])


def test_reasoning_comes_back_through_encrypted_content(oai, model, hf):
    """`include: ["reasoning.encrypted_content"]`: a reasoning item carries its text opaquely, and
    a stateless client that sends back only that (no content, no summary, as clients do with
    OpenAI's) gets it rendered in the next turn as transformers renders that reasoning_content."""
    r = oai.responses.create(
        model=model,
        input="Time?",
        tools=[TOOL],
        include=["reasoning.encrypted_content"],
        temperature=0.0,
        max_output_tokens=8,
        extra_body=BIAS,
    )
    (rs,) = [it for it in r.output if it.type == "reasoning"]
    text = rs.content[0].text
    assert text and rs.encrypted_content and text not in rs.encrypted_content
    items = [
        {"role": "user", "content": "Time?"},
        {"type": "reasoning", "id": rs.id, "summary": [], "encrypted_content": rs.encrypted_content},
        {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"utc": true}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
    ]
    r2 = oai.responses.create(model=model, input=items, tools=[TOOL], temperature=0.0, max_output_tokens=2)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"utc": True}}}
    msgs = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "reasoning_content": text.strip("\n"), "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    want = hf.apply_chat_template(msgs, tools=[CHAT_TOOL], add_generation_prompt=True, tokenize=False)
    assert r2.usage.input_tokens == len(hf.encode(want, add_special_tokens=False))
    plain = oai.responses.create(model=model, input="Time?", tools=[TOOL], temperature=0.0, max_output_tokens=8)
    assert all(getattr(it, "encrypted_content", None) is None for it in plain.output)  # only when asked


# ---- stored responses (router/responses_store.py) ------------------------------------------------
def _dicts(items) -> list[dict]:
    return [it.model_dump(exclude_none=True) for it in items]


def test_previous_response_id_continues_the_stored_conversation(oai, model, hf):
    """A response continued by previous_response_id sees the prompt of the whole conversation sent
    as input (its items, then the first response's output, then the new input), which is
    transformers' rendering of those turns, and answers it alike (greedy); retrieve gives the
    stored response back and input_items lists the conversation in order."""
    kw = dict(model=model, temperature=0.0, max_output_tokens=8, extra_body=BIAS)
    r1 = oai.responses.create(input="Hello there.", **kw)
    assert r1.store is True and r1.previous_response_id is None
    r2 = oai.responses.create(previous_response_id=r1.id, input="And then?", instructions="Be brief.", **kw)
    assert r2.previous_response_id == r1.id and r2.store is True
    whole = [{"role": "user", "content": "Hello there."}, *_dicts(r1.output), {"role": "user", "content": "And then?"}]
    r3 = oai.responses.create(input=whole, instructions="Be brief.", store=False, **kw)
    assert r3.store is False
    assert r2.usage.input_tokens == r3.usage.input_tokens and _plain(r2.output) == _plain(r3.output)
    said = {it.type: it.content[0].text for it in r1.output}
    turn = {"role": "assistant", "content": said.get("message", "")}
    if "reasoning" in said:
        turn["reasoning_content"] = said["reasoning"].strip("\n")
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there."},
        turn,
        {"role": "user", "content": "And then?"},
    ]
    want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert r2.usage.input_tokens == len(hf.encode(want, add_special_tokens=False))
    got = oai.responses.retrieve(r1.id)
    assert got.id == r1.id and _plain(got.output) == _plain(r1.output) and got.usage == r1.usage
    listed = oai.responses.input_items.list(r2.id, order="asc")
    kinds = [(it.type, getattr(it, "role", None)) for it in listed.data]
    assert kinds == [
        ("message", "user"),
        *[(it.type, getattr(it, "role", None)) for it in r1.output],
        ("message", "user"),
    ]
    assert listed.data[0].content[0].text == "Hello there." and listed.data[-1].content[0].text == "And then?"
    newest = oai.responses.input_items.list(r2.id, limit=1)  # desc by default: the newest first
    assert [it.id for it in newest.data] == [listed.data[-1].id] and newest.has_more


def test_a_chain_outlives_its_first_response_and_unknown_ids_are_refused(oai, model):
    import openai

    kw = dict(model=model, temperature=0.0, max_output_tokens=4, extra_body=BIAS)
    r1 = oai.responses.create(input="One.", **kw)
    r2 = oai.responses.create(previous_response_id=r1.id, input="Two.", **kw)
    deleted = oai.responses.delete(r1.id)
    assert deleted is None or getattr(deleted, "deleted", True)  # the SDK returns None for it
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r1.id)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(previous_response_id=r1.id, input="Three.", **kw)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    r3 = oai.responses.create(previous_response_id=r2.id, input="Three.", **kw)  # r2 holds r1's turns
    assert r3.usage.input_tokens > r2.usage.input_tokens > r1.usage.input_tokens
    kinds = [it.type for it in oai.responses.input_items.list(r3.id, order="asc", limit=100).data]
    assert kinds[0] == "message" and len(kinds) == 3 + len(r1.output) + len(r2.output)
    unstored = oai.responses.create(input="Four.", store=False, **kw)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_a_streamed_response_is_stored_once_complete(oai, model):
    kw = dict(model=model, input="Stream it.", temperature=0.0, max_output_tokens=6, extra_body=BIAS)
    items, final, kinds = _streamed(oai, **kw)
    assert final.store is True
    got = oai.responses.retrieve(final.id)
    assert _plain(got.output) == _plain(items) and got.status == final.status
    nxt = oai.responses.create(previous_response_id=final.id, **dict(kw, input="More."))
    assert nxt.previous_response_id == final.id and nxt.usage.input_tokens > final.usage.input_tokens


def test_a_tool_call_continued_by_previous_response_id(oai, model, hf):
    """The agent loop over stored responses: a required call, then only its output sent with
    previous_response_id; the prompt is transformers' rendering of the user turn, the call and
    the tool's answer."""
    kw = dict(model=model, tools=[TOOL], temperature=0.0, extra_body=NO_THINK)
    r1 = oai.responses.create(input="Time?", tool_choice="required", max_output_tokens=100, **kw)
    calls = [it for it in r1.output if it.type == "function_call"]
    assert r1.status == "completed" and calls
    outs = [{"type": "function_call_output", "call_id": c.call_id, "output": "12:00"} for c in calls]
    r2 = oai.responses.create(previous_response_id=r1.id, input=outs, max_output_tokens=2, **kw)
    tool_calls = [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
        for c in calls
    ]
    msgs = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "tool_calls": tool_calls},
        *[{"role": "tool", "tool_call_id": c.call_id, "content": "12:00"} for c in calls],
    ]
    want = hf.apply_chat_template(
        msgs, tools=[CHAT_TOOL], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert r2.usage.input_tokens == len(hf.encode(want, add_special_tokens=False))


def test_the_store_shows_in_the_router_metrics(oai, model, http_up):
    from tests.helpers.serve_harness import log_url, scrape

    url = log_url(http_up, r"OpenAI-compatible HTTP on (http://\S+)/v1") + "/metrics"  # the HTTP app's own
    before = scrape(url)[("pdserve_router_responses_stored", ())]
    r = oai.responses.create(model=model, input="Count me.", temperature=0.0, max_output_tokens=2)
    m = scrape(url)
    assert (
        m[("pdserve_router_responses_stored", ())] == before + 1
        and m[("pdserve_router_responses_stored_bytes", ())] > 0
    )
    oai.responses.delete(r.id)
    assert scrape(url)[("pdserve_router_responses_stored", ())] == before


def test_truncation_auto_drops_the_oldest_turns_until_it_fits(oai, model, hf):
    """A conversation longer than the context: refused with truncation disabled (the default);
    with truncation "auto" its first turns are dropped, the fewest that leave max_output_tokens,
    and the prompt is transformers' rendering of the turns left (a naive loop finds them)."""
    import openai

    ctx = oai.models.list().data[0].model_extra["max_model_len"]
    out = 8

    def conversation(n: int) -> list[tuple[str, str]]:
        return [(f"Turn {t}: " + "lorem ipsum " * 40, f"Reply {t}.") for t in range(n)]

    def rendered(kept) -> int:
        msgs = [m for u, a in kept for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})]
        msgs = msgs[:-1]  # the last turn's question is the input's end
        text = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return len(hf.encode(text, add_special_tokens=False))

    per = rendered(conversation(2)) - rendered(conversation(1))
    n = max(3, ctx // per + 3)  # enough turns to overflow the context, each a part of it
    turns = conversation(n)
    assert rendered(turns) + out > ctx
    want = next(rendered(turns[k:]) for k in range(n) if rendered(turns[k:]) + out <= ctx)
    items = [m for u, a in turns for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})][:-1]
    kw = dict(model=model, input=items, temperature=0.0, max_output_tokens=out, extra_body=BIAS, store=False)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(**kw)
    r = oai.responses.create(truncation="auto", **kw)
    assert r.truncation == "auto" and r.usage.input_tokens == want and r.usage.output_tokens == out
