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
