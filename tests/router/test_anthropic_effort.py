"""Anthropic's `output_config.effort` reaches the chat template as OpenAI's `reasoning_effort`
(router/anthropic_request.py): a template that reads it renders what transformers'
`apply_chat_template` renders with that keyword; a value outside low / medium / high is a 400
naming the field."""

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
