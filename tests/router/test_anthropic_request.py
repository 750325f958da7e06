"""Anthropic request fields mapped onto chat's (router/anthropic_request.py): `output_config.effort`
reaches the chat template as OpenAI's `reasoning_effort` (a template that reads it renders what
transformers' `apply_chat_template` renders with that keyword; a value outside low / medium / high
is a 400 naming the field); a tool's `strict: true` is chat's strict tool."""

from __future__ import annotations

import pytest

from router.anthropic_request import MessagesRequest, to_chat
from router.chat_template import ChatTemplate
from router.openai_models import ApiError

# a template of the kind that reads an effort switch (gpt-oss-style), kept minimal
EFFORT_TEMPLATE = (
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{%- endfor %}"
    "{%- if reasoning_effort is defined %}<|effort|>{{ reasoning_effort }}{%- endif %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}]


def _body(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": MESSAGES, **kw})


@pytest.mark.parametrize("effort", [None, "low", "medium", "high"])
def test_effort_renders_as_transformers_does(effort):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")))
    kw = {} if effort is None else {"reasoning_effort": effort}
    want = hf.apply_chat_template(
        MESSAGES, chat_template=EFFORT_TEMPLATE, add_generation_prompt=True, tokenize=False, **kw
    )
    cfg = {} if effort is None else {"output_config": {"effort": effort}}
    chat = to_chat(_body(**cfg))
    assert ChatTemplate(EFFORT_TEMPLATE).render(chat).prompt == want
    assert ("<|effort|>" in want) == (effort is not None)


@pytest.mark.parametrize("effort", ["max", "none", 3])
def test_unknown_effort_is_a_400_naming_it(effort):
    with pytest.raises(ApiError) as ei:
        to_chat(_body(output_config={"effort": effort}))
    assert ei.value.status == 400 and ei.value.param == "output_config.effort", ei.value


def test_strict_tools_are_chat_strict_tools():
    """A tool's `strict: true` (Anthropic's structured outputs) is chat's: under `auto`, the
    calls are constrained (router/tool_choice.py); without it, as before."""
    from router.tool_choice import plan

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for strict in (True, None):
        tool = {"name": "t", "input_schema": schema} | ({"strict": strict} if strict else {})
        chat = to_chat(_body(tools=[tool]))
        assert chat.tools[0]["function"].get("strict") is strict
        c = plan(chat, "xml", None).constraint
        assert (c is not None and c.grammar.startswith("start: TEXT")) == bool(strict)


def _encoded(fmt: str) -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 10, 10)).save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode()


def _with_image(media_type, data) -> MessagesRequest:
    image = {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    return _body(messages=[{"role": "user", "content": [image, {"type": "text", "text": "?"}]}])


@pytest.mark.parametrize(
    "fmt,media", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("GIF", "image/gif"), ("WEBP", "image/webp")]
)
def test_an_image_of_its_declared_type_is_a_data_url(fmt, media):
    data = _encoded(fmt)
    chat = to_chat(_with_image(media, data))
    part = chat.messages[0].content[0]
    assert part["image_url"]["url"] == f"data:{media};base64,{data}"


@pytest.mark.parametrize(
    "media,data,param,words",
    [
        ("image/jpeg", "PNG", "messages[0].content[0].source.media_type", "the image is image/png data"),
        ("image/png", "GIF", "messages[0].content[0].source.media_type", "the image is image/gif data"),
        ("image/bmp", "PNG", "messages[0].content[0].source.media_type", "must be one of"),
        (None, "PNG", "messages[0].content[0].source.media_type", "must be one of"),
        ("image/png", "!!not base64!!", "messages[0].content[0].source.data", "is not valid base64"),
        ("image/png", "AAAA", "messages[0].content[0].source.media_type", "none of those formats"),
    ],
)
def test_base64_images_are_refused_as_anthropic_refuses_them(media, data, param, words):
    """Anthropic's four media types only, valid base64, and bytes of the type the block names
    (its API answers a PNG sent as image/jpeg with a 400); the message names the source's field,
    not a data: URL the client never wrote."""
    if data in ("PNG", "GIF"):
        data = _encoded(data)
    with pytest.raises(ApiError) as ei:
        to_chat(_with_image(media, data))
    e = ei.value
    assert e.status == 400 and e.param == param and words in str(e) and "data: URL" not in str(e), e


def test_a_thinking_budget_must_be_below_max_tokens():
    """As Anthropic's API: `max_tokens` must be greater than `thinking.budget_tokens`."""
    with pytest.raises(ApiError) as ei:
        to_chat(_body(thinking={"type": "enabled", "budget_tokens": 8}))
    assert ei.value.status == 400 and ei.value.param == "max_tokens", ei.value
    assert to_chat(_body(thinking={"type": "enabled", "budget_tokens": 7})).thinking_token_budget == 7


def test_too_many_stop_sequences_are_named_as_sent():
    with pytest.raises(ApiError) as ei:
        to_chat(_body(stop_sequences=[f"s{i}" for i in range(65)]))
    assert ei.value.param == "stop_sequences" and str(ei.value).startswith("stop_sequences has 65 strings")
    with pytest.raises(ApiError) as ei:
        to_chat(_body(stop_sequences=["ok", "x" * 300]))
    assert ei.value.param == "stop_sequences" and str(ei.value).startswith("stop_sequences[1] has 300 characters")


_TOOL = {"name": "t", "input_schema": {"type": "object"}}


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tool_choice": {"type": "tool", "name": "t"}}, "tool_choice"),
        ({"tool_choice": {"type": "any"}, "tools": []}, "tool_choice"),
        ({"tools": [{"name": "t"}]}, "tools[0].input_schema"),
        ({"tools": [{"name": "t", "input_schema": "object"}]}, "tools[0].input_schema"),
        ({"tools": [_TOOL, {"name": "u", "input_schema": None}]}, "tools[1].input_schema"),
    ],
)
def test_tool_fields_anthropic_refuses_are_400s_naming_them(kw, param):
    """Anthropic's API answers these with a 400: a forced tool choice (`any`, `tool`) with no
    tools to call, and a tool without an `input_schema` object (a required field there)."""
    with pytest.raises(ApiError) as ei:
        to_chat(_body(**kw))
    assert ei.value.status == 400 and ei.value.param == param and param in str(ei.value), ei.value


@pytest.mark.parametrize("choice", [None, {"type": "auto"}, {"type": "none"}])
def test_an_unforced_tool_choice_without_tools_is_served(choice):
    assert to_chat(_body(tool_choice=choice)).tools is None


@pytest.mark.parametrize("bad_input", ["{}", ["x"], 3, None, "missing"])
def test_a_tool_use_whose_input_is_not_an_object_is_a_400(bad_input):
    """An assistant `tool_use` block's `input` is an object in Anthropic's API (required); any
    other value (or none) is a 400 naming the block's field, not a call rendered with `{}`."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "t"} | ({} if bad_input == "missing" else {"input": bad_input})
    msgs = [*MESSAGES, {"role": "assistant", "content": [call]}, {"role": "user", "content": "ok"}]
    with pytest.raises(ApiError) as ei:
        to_chat(_body(messages=msgs, tools=[_TOOL]))
    e = ei.value
    assert e.status == 400 and e.param == "messages[1].content[0].input" and e.param in str(e), e
    call["input"] = {"a": 1}
    fn = to_chat(_body(messages=msgs, tools=[_TOOL])).messages[1].tool_calls[0]["function"]
    assert fn["name"] == "t" and fn["arguments"] in ('{"a": 1}', {"a": 1})


@pytest.mark.parametrize("kind", ["enabled", "adaptive", "between_tools", "disabled"])
def test_every_thinking_type_the_error_lists_is_accepted(kind):
    """The 400 for an unknown `thinking.type` lists what is accepted, and each listed type is."""
    with pytest.raises(ApiError) as ei:
        to_chat(_body(thinking={"type": "sometimes"}))
    msg = str(ei.value)
    assert ei.value.param == "thinking.type" and "must be one of " in msg, msg
    assert kind in msg.split("must be one of ", 1)[1].split(", "), msg
    want = kind != "disabled"
    assert to_chat(_body(thinking={"type": kind})).chat_template_kwargs == {"enable_thinking": want}
