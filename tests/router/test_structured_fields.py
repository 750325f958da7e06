"""The structured-output fields of chat and completions bodies (router/structured_fields.py),
without processes: each way of writing a constraint gives the constraint it names, GBNF becomes a
Lark grammar that accepts the same strings (llguidance's own matcher, with a byte-level check),
and a body naming two constraints or a malformed one is a 400 naming the field."""

from __future__ import annotations

import re

import pytest

from router.openai_models import ApiError, ChatRequest, CompletionRequest, parse
from router.structured_fields import constraint

MSGS = [{"role": "user", "content": "x"}]


def _c(**body):
    req = parse(CompletionRequest, dict(body, model="m", prompt="x"))
    return constraint(req)


def test_each_spelling_names_its_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert _c(guided_choice=["a", "b"]).choice.choices == ["a", "b"]
    assert _c(structured_outputs={"choice": ["a", "b"]}).choice.choices == ["a", "b"]
    assert _c(guided_regex="[0-9]+").regex == _c(regex="[0-9]+").regex == "[0-9]+"
    assert _c(structured_outputs={"regex": "[0-9]+", "disable_fallback": True}).regex == "[0-9]+"
    import json

    for body in (
        dict(guided_json=schema),
        dict(guided_json=json.dumps(schema)),
        dict(structured_outputs={"json": schema}),
    ):
        assert json.loads(_c(**body).json_schema) == schema
    assert _c(structured_outputs={"json_object": True}).json_object
    assert _c(response_format={"type": "json_object"}).json_object
    assert _c(response_format={"type": "text"}) is None and _c() is None
    lark = 'start: "a" B\nB: /[0-9]/'
    assert _c(guided_grammar=lark).grammar == lark == _c(structured_outputs={"grammar": lark}).grammar
    chat = parse(ChatRequest, dict(model="m", messages=MSGS, guided_choice=["x"]))
    assert constraint(chat).choice.choices == ["x"]


def test_gbnf_is_converted_to_a_grammar_that_accepts_the_same_strings():
    import llguidance

    g = _c(ebnf='root ::= "id-" d d ("x" | "yz")\nd ::= [0-9]').grammar
    assert "::=" not in g

    def accepts(s: str) -> bool:
        m = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), llguidance.LLMatcher.grammar_from_lark(g))
        return all(m.consume_token(b) for b in s.encode()) and m.is_accepting()

    ref = re.compile(r"id-[0-9]{2}(x|yz)")
    for s in ("id-12x", "id-99yz", "id-1x", "id-12", "id-12y", "ID-12x", "id-123x"):
        assert accepts(s) == bool(ref.fullmatch(s)), s


@pytest.mark.parametrize(
    "body,param",
    [
        (dict(guided_choice=["a"], guided_regex="a"), "guided_choice"),
        (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "structured_outputs"),
        (dict(structured_outputs={"choice": ["a"], "regex": "a"}), "structured_outputs"),
        (dict(structured_outputs={}), "structured_outputs"),
        (dict(structured_outputs={"structural_tag": "t"}), "structured_outputs"),
        (dict(structured_outputs="json"), "structured_outputs"),
        (dict(guided_choice=[]), "guided_choice"),
        (dict(guided_choice=["a", 1]), "guided_choice"),
        (dict(guided_json="{no"), "guided_json"),
        (dict(guided_json=[1]), "guided_json"),
        (dict(guided_regex=""), "guided_regex"),
        (dict(ebnf="root ::= ("), "ebnf"),
        (dict(structured_outputs={"json_object": "yes"}), "structured_outputs.json_object"),
        (dict(response_format={"type": "yaml"}), "response_format"),
    ],
)
def test_malformed_or_doubled_constraints_are_400s_naming_the_field(body, param):
    with pytest.raises(ApiError) as e:
        _c(**body)
    assert e.value.status == 400 and e.value.param == param, str(e.value)
