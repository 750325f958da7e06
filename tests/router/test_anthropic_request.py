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
