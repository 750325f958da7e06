"""Qwen3-Next's call layout, served: the tiny qwen3_next checkpoint's template writes Qwen3's JSON
calls (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, engine/tiny_template.py),
and `pdserve up` finds that format in it. Through the official `openai` client: required calls,
`strict` tools under `auto` and a custom tool's regex grammar give calls whose arguments validate
(jsonschema) and whose input is in the grammar (Python's `re`), streamed the same; a custom tool's
Lark grammar is a 400 saying why."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.agent_tools import WEATHER

TOOL = WEATHER
PATCH_RE = r"(add|del) [a-z]{1,8}\.py"
USER = [{"role": "user", "content": "Weather in Paris?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The conftest's cluster fixtures serve this checkpoint in this module."""
    spec = dataclasses.replace(hc.SPEC_MOE["qwen3_next"], tokenizer=True, vocab=1024)
    return hc.make(tmp_path_factory.mktemp("next") / "ckpt", spec)


def _streamed_calls(oai, **kw) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for ch in oai.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            for tc in c.delta.tool_calls or ():
                got = calls.setdefault(tc.index, ["", ""])
                got[0] += tc.function.name or ""
                got[1] += tc.function.arguments or ""
    return [(n, a) for n, a in calls.values()]


def test_the_template_writes_json_calls(ckpt):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(ckpt).chat_template
    assert "<tool_call>" in t and "<function=" not in t


@pytest.mark.parametrize("choice", ["required", "auto-strict"])
def test_calls_follow_the_schema(oai, model, hf_next, choice):
    import jsonschema

    tool = TOOL if choice == "required" else {"type": "function", "function": {**TOOL["function"], "strict": True}}
    extra = dict(NO_THINK)
    if choice != "required":  # the random model is pushed towards a call
        extra["logit_bias"] = {str(hf_next.convert_tokens_to_ids("<tool_call>")): 6}
    kw = dict(
        model=model,
        messages=USER,
        tools=[tool],
        tool_choice="required" if choice == "required" else "auto",
        temperature=0.0,
        max_tokens=200,
        extra_body=extra,
    )
    c = oai.chat.completions.create(**kw).choices[0]
    assert c.message.tool_calls, c
    for call in c.message.tool_calls:
        assert call.function.name == "get_weather"
        assert call.function.arguments, c
        jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    assert _streamed_calls(oai, **kw) == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_custom_tool_grammars(oai, model):
    import openai

    def custom(syntax: str, definition: str) -> dict:
        fmt = {"type": "grammar", "grammar": {"syntax": syntax, "definition": definition}}
        return {"type": "custom", "custom": {"name": "patch", "format": fmt}}

    kw = dict(model=model, messages=USER, max_tokens=200, extra_body=NO_THINK)
    choice = {"type": "custom", "custom": {"name": "patch"}}
    for seed in range(2):
        r = oai.chat.completions.create(
            tools=[custom("regex", PATCH_RE)], tool_choice=choice, temperature=1.0, seed=seed, **kw
        )
        (call,) = r.choices[0].message.tool_calls
        assert call.type == "custom" and re.fullmatch(PATCH_RE, call.custom.input), call
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(tools=[custom("lark", 'start: "a"')], tool_choice=choice, **kw)
    assert "XML call format" in str(e.value)


@pytest.fixture(scope="module")
def hf_next(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)
