"""The structured-output fields of chat and completions bodies (router/structured_fields.py),
without processes: each way of writing a constraint gives the constraint it names, GBNF becomes a
Lark grammar that accepts the same strings (llguidance's own matcher, with a byte-level check),
and a body naming two constraints or a malformed one is a 400 naming the field."""

from __future__ import annotations

import json
import re

import llguidance
import pytest

from engine.structured.grammar import grammar_text
from router.openai_models import ApiError, ChatRequest, CompletionRequest, parse
from router.structured_fields import constraint

MSGS = [{"role": "user", "content": "x"}]


def _c(**body):
    req = parse(CompletionRequest, dict(body, model="m", prompt="x"))
    return constraint(req)


def test_each_spelling_names_its_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json.loads(_c(json_schema=json.dumps(schema)).json_schema) == schema  # SGLang's
    assert json.loads(_c(json_schema=schema).json_schema) == schema
    assert _c(guided_choice=["a", "b"]).choice.choices == ["a", "b"]
    assert _c(structured_outputs={"choice": ["a", "b"]}).choice.choices == ["a", "b"]
    assert _c(guided_regex="[0-9]+").regex == _c(regex="[0-9]+").regex == "[0-9]+"
    assert _c(structured_outputs={"regex": "[0-9]+", "disable_fallback": True}).regex == "[0-9]+"
    # JSON options leave other kinds as they are
    assert _c(structured_outputs={"regex": "[0-9]+", "disable_any_whitespace": True}).regex == "[0-9]+"
    assert _c(regex="[0-9]+", structured_outputs={"disable_any_whitespace": True}).regex == "[0-9]+"

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


TAG = {
    "structures": [{"begin": "<function=f>", "schema": {"type": "object"}, "end": "</function>"}],
    "triggers": ["<function="],
}


def test_structural_tags_become_their_grammar_on_chat_and_completions():
    """vLLM's response_format type structural_tag (SGLang's too) and structured_outputs'
    structural_tag (the tag's JSON text) both give the tag's grammar, which takes a tagged call
    in free text and refuses a call the tag does not name."""
    rf = dict(TAG, type="structural_tag")
    g = _c(response_format=rf).grammar
    assert g == _c(structured_outputs={"structural_tag": json.dumps(rf)}).grammar
    chat = parse(ChatRequest, dict(model="m", messages=MSGS, response_format=rf))
    assert constraint(chat).grammar == g

    def takes(text: str) -> bool:
        m = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), grammar_text("grammar", g), log_level=0)
        return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()

    assert takes('hi <function=f>{"a": 1}</function> bye') and not takes("hi <function=g>{}</function>")


@pytest.mark.parametrize(
    "body,param,words",
    [
        (dict(response_format={"type": "structural_tag"}), "response_format", "'structures' and 'triggers'"),
        (
            dict(response_format=dict(TAG, type="structural_tag", triggers=["<tool>"])),
            "response_format",
            "response_format.structures[0].begin '<function=f>' starts with none of the triggers",
        ),
        (
            dict(structured_outputs={"structural_tag": json.dumps(dict(TAG, structures=[{"begin": "<function=f>"}]))}),
            "structured_outputs.structural_tag",
            "structured_outputs.structural_tag.structures[0] needs 'schema'",
        ),
        (
            dict(response_format={"type": "structural_tag", "format": {"type": "regex", "pattern": "("}}),
            "response_format",
            "response_format",
        ),
        (
            dict(structured_outputs={"structural_tag": "{}", "regex": "a"}),
            "structured_outputs",
            "exactly one of",
        ),
    ],
)
def test_malformed_structural_tags_are_400s_naming_the_field(body, param, words):
    with pytest.raises(ApiError) as e:
        _c(**body)
    assert e.value.status == 400 and e.value.param == param and words in str(e.value), str(e.value)


def _accepts(c, text: str) -> bool:
    """Whether the constraint's grammar takes `text` (llguidance's byte tokenizer)."""
    kind = c.WhichOneof("kind")
    value = c.json_schema if kind == "json_schema" else ""
    m = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), grammar_text(kind, value), log_level=0)
    return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()


NESTED = {
    "type": "object",
    "properties": {
        "a": {"type": "integer"},
        "o": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "properties": {"type": "integer"},  # a property of that name is not a schema keyword
    },
}
VALUE = {"a": 1, "o": {"b": 2}, "properties": 3}


@pytest.mark.parametrize(
    "body",
    [
        dict(structured_outputs={"json": NESTED, "disable_any_whitespace": True}),
        dict(
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": NESTED}},
            structured_outputs={"disable_any_whitespace": True},
        ),
        dict(guided_json=NESTED, guided_decoding_backend="xgrammar:disable-any-whitespace"),
        dict(json_schema=NESTED, structured_outputs={"disable_any_whitespace": True}),
        dict(structured_outputs={"json_object": True, "disable_any_whitespace": True}),
    ],
    ids=["structured_outputs", "with-response_format", "guided-backend-option", "with-json_schema", "json_object"],
)
def test_disable_any_whitespace_gives_compact_json(body):
    c = _c(**body)
    assert _accepts(c, json.dumps(VALUE, separators=(",", ":")))
    assert not _accepts(c, json.dumps(VALUE))  # ", " and ": "
    assert not _accepts(c, json.dumps(VALUE, indent=2))


@pytest.mark.parametrize(
    "body",
    [
        dict(structured_outputs={"json": NESTED, "disable_additional_properties": True}),
        dict(guided_json=NESTED, guided_decoding_backend="guidance:no-additional-properties"),
    ],
    ids=["structured_outputs", "guided-backend-option"],
)
def test_disable_additional_properties_closes_every_object(body):
    import jsonschema

    c = _c(**body)
    assert _accepts(c, json.dumps(VALUE))
    for extra in ({**VALUE, "z": 1}, {**VALUE, "o": {"b": 2, "z": 1}}):
        jsonschema.validate(extra, NESTED)  # the schema alone allows the extra key
        assert not _accepts(c, json.dumps(extra)), extra
    assert _accepts(_c(guided_json=NESTED), json.dumps({**VALUE, "z": 1}))  # without the option


def test_whitespace_pattern_is_the_json_whitespace():
    one_blank = (VALUE, {"separators": (", ", ": ")})
    for body in (
        dict(guided_json=NESTED, guided_whitespace_pattern=r"\x20?"),
        dict(structured_outputs={"json": NESTED, "whitespace_pattern": r"\x20?"}),
    ):
        c = _c(**body)
        assert _accepts(c, json.dumps(one_blank[0], **one_blank[1]))
        assert not _accepts(c, json.dumps(VALUE, indent=2))


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
        (dict(structured_outputs={"structural_tag": "t"}), "structured_outputs.structural_tag"),
        (dict(structured_outputs="json"), "structured_outputs"),
        (dict(guided_choice=[]), "guided_choice"),
        (dict(guided_choice=["a", 1]), "guided_choice"),
        (dict(guided_json="{no"), "guided_json"),
        (dict(guided_json=[1]), "guided_json"),
        (dict(guided_regex=""), "guided_regex"),
        (dict(ebnf="root ::= ("), "ebnf"),
        (dict(structured_outputs={"json_object": "yes"}), "structured_outputs.json_object"),
        (dict(response_format={"type": "yaml"}), "response_format"),
        (dict(json_schema="{no"), "json_schema"),
        (dict(guided_json={"type": "object"}, json_schema={"type": "object"}), "json_schema"),
        (
            dict(structured_outputs={"json": {}, "disable_any_whitespace": "yes"}),
            "structured_outputs.disable_any_whitespace",
        ),
        (dict(guided_json={}, guided_whitespace_pattern=3), "guided_whitespace_pattern"),
        (dict(guided_json={}, guided_decoding_backend=["xgrammar"]), "guided_decoding_backend"),
    ],
)
def test_malformed_or_doubled_constraints_are_400s_naming_the_field(body, param):
    with pytest.raises(ApiError) as e:
        _c(**body)
    assert e.value.status == 400 and e.value.param == param, str(e.value)


def _responses(fmt):
    from router.responses_request import ResponsesRequest, to_chat

    return constraint(to_chat(ResponsesRequest.model_validate({"model": "m", "input": "x", "text": {"format": fmt}})))


def _messages(**fmt):
    from router.anthropic_request import MessagesRequest, to_chat

    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], **fmt}
    return constraint(to_chat(MessagesRequest.model_validate(body)))


@pytest.mark.parametrize(
    "make,param",
    [
        (lambda: _responses({"type": "json_schema", "name": "n", "schema": {"type": "frob"}}), "text.format"),
        (lambda: _responses({"type": "json_schema", "name": "n"}), "text.format"),
        (lambda: _responses({"type": "regex"}), "text.format"),
        (
            lambda: _messages(output_config={"format": {"type": "json_schema", "schema": {"not": {}}}}),
            "output_config.format",
        ),
        (lambda: _messages(output_format={"type": "json_schema", "schema": {"type": "frob"}}), "output_format"),
    ],
    ids=[
        "responses-schema",
        "responses-no-schema",
        "responses-type",
        "messages-output_config",
        "messages-output_format",
    ],
)
def test_a_bad_format_is_named_as_the_body_has_it(make, param):
    with pytest.raises(ApiError) as e:
        make()
    assert e.value.status == 400 and e.value.param == param, str(e.value)
    assert "response_format" not in str(e.value), str(e.value)


def test_formats_of_other_bodies_constrain():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json.loads(_responses({"type": "json_schema", "name": "n", "schema": schema}).json_schema) == schema
    assert _responses({"type": "json_object"}).json_object
    assert json.loads(_messages(output_format={"type": "json_schema", "schema": schema}).json_schema) == schema
