"""Structural tags served (`pdserve up`: router, one prefill and one decode node) to the official
`openai` client: vLLM's legacy `response_format` on chat and its `structured_outputs.structural_tag`
on completions. A random model calls nothing by itself, so the trigger is a token its constrained
greedy text holds anyway: from there each tag must be one the tag names, with JSON that validates
(jsonschema) and its end string (tests/helpers/struct_tags.py scans the text independently)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.helpers.struct_tags import scan

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
NEVER = "\u2603\u2603"  # a trigger the tiny model's text does not hold


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


def _tag(trigger: str) -> dict:
    return {
        "type": "structural_tag",
        "structures": [
            {"begin": trigger + "get_weather>", "schema": WEATHER, "end": "</function>"},
            {"begin": trigger + "get_time>", "schema": {"type": "object", "maxProperties": 0}, "end": "</function>"},
        ],
        "triggers": [trigger],
    }


def _trigger(hf, ids: list[int]) -> str:
    """The text of the first token the output holds whose text appears there first at that token."""
    for k in range(1, len(ids)):
        piece, before = hf.decode(ids[k : k + 1]), hf.decode(ids[:k])
        if piece.strip() and "\ufffd" not in piece and (before + piece).find(piece) == len(before):
            return piece
    raise AssertionError(f"no usable token in {ids}")


def test_chat_response_format_structural_tag(oai, model, hf):
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        temperature=0.0,
        max_tokens=60,
    )
    extra = {"ignore_eos": True, "return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}}
    free = oai.chat.completions.create(response_format=_tag(NEVER), extra_body=extra, **kw).choices[0]
    assert scan(_tag(NEVER), free.message.content) == 0
    trigger = _trigger(hf, free.token_ids)  # type: ignore[attr-defined]
    tag = _tag(trigger)
    r = oai.chat.completions.create(response_format=tag, extra_body=extra, **kw).choices[0]
    text = r.message.content
    head = free.message.content[: free.message.content.find(trigger)]
    assert text.startswith(head + trigger + "get_"), (trigger, text)
    n = scan(tag, text, cut=r.finish_reason == "length")
    assert n is not None and n >= 1, (trigger, text, r.finish_reason)


def test_completions_structured_outputs_structural_tag(oai, model):
    """The tag as vLLM's `structured_outputs.structural_tag` JSON text, in xgrammar's format form:
    one call first and nothing after (`at_least_one`, `stop_after_first`), so the output is
    exactly the tag and the request stops."""
    fmt = {
        "type": "triggered_tags",
        "triggers": ["<function="],
        "tags": [
            {
                "type": "tag",
                "begin": "<function=get_weather>",
                "content": {"type": "json_schema", "json_schema": WEATHER},
                "end": "</function>",
            }
        ],
        "at_least_one": True,
        "stop_after_first": True,
    }
    so = {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt})}
    r = oai.completions.create(
        model=model, prompt="Call:", temperature=0.0, max_tokens=60, extra_body={"structured_outputs": so}
    ).choices[0]
    assert r.finish_reason == "stop", r
    assert r.text.startswith("<function=get_weather>") and r.text.endswith("</function>"), r.text
    jsonschema.validate(json.loads(r.text[len("<function=get_weather>") : -len("</function>")]), WEATHER)


def test_a_trigger_the_model_writes_as_its_added_token(oai, model, hf):
    """`<tool_call>` is an added token (Qwen's layout): with logit_bias pushing it, the model
    writes the token, which starts a tag as its spelling would; every tag in the output is
    valid (its JSON per the schema, its end)."""
    call = hf.convert_tokens_to_ids("<tool_call>")
    schema = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}
    tag = {
        "type": "structural_tag",
        "structures": [
            {"begin": "<tool_call>\n", "schema": dict(schema, additionalProperties=False), "end": "\n</tool_call>"}
        ],
        "triggers": ["<tool_call>"],
    }
    extra = {"ignore_eos": True, "logit_bias": {str(call): 30}, "return_token_ids": True}
    r = oai.completions.create(
        model=model, prompt="Time?", temperature=0.0, max_tokens=40, extra_body=dict(extra, response_format=tag)
    ).choices[0]
    assert r.model_extra["token_ids"].count(call) >= 2, r.text
    n = scan(tag, r.text, cut=r.finish_reason == "length")
    assert n is not None and n >= 2, r.text
