"""Tool parameter schemas as agents' frameworks write them (pydantic: nested models and enums
under `$defs` reached by `$ref`, `Optional[X]` as `anyOf` X and null; OpenAI's strict mode and zod:
`"type": ["string", "null"]`; a bare `enum`), on the router tests' checkpoint's Qwen3.5-shaped
template. References: transformers renders an assistant call with the arguments (the text the
model is trained to write); a forced call's grammar (llguidance on the checkpoint's tokenizer)
accepts that text and refuses arguments the schema refuses (jsonschema says which); the parser
gives back the very arguments, which validate. The JSON call format (Qwen3-Next's) is checked the
same way on `json.dumps` of the call."""

from __future__ import annotations

import json

import jsonschema
import pytest

from router.openai_models import ChatRequest
from router.parsers.tool_calls import ToolCallParser, ToolDelta

ADDRESS = {
    "type": "object",
    "properties": {"street": {"type": "string"}, "zip": {"type": "integer"}},
    "required": ["street", "zip"],
    "title": "Address",
}
PARAMS = {
    "$defs": {"Address": ADDRESS, "Unit": {"enum": ["c", "f"], "title": "Unit", "type": "string"}},
    "type": "object",
    "properties": {
        "home": {"$ref": "#/$defs/Address"},
        "work": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}], "default": None},
        "unit": {"$ref": "#/$defs/Unit"},
        "note": {"type": ["string", "null"]},
        "tag": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
        "mode": {"enum": ["fast", "slow"]},
    },
    "required": ["home", "work", "unit", "note", "tag", "mode"],
}
TOOL = {"type": "function", "function": {"name": "plan_trip", "parameters": PARAMS}}
HOME = {"street": "Rue de Rivoli 1", "zip": 75001}
GOOD = [
    {"home": HOME, "work": None, "unit": "c", "note": 'bring "keys" <b>', "tag": "x1", "mode": "fast"},
    {"home": HOME, "work": HOME, "unit": "f", "note": None, "tag": None, "mode": "slow"},
    {"home": HOME, "work": None, "unit": "f", "note": "null?", "tag": "", "mode": "fast"},
]
BAD = [
    {**GOOD[0], "home": {"street": "x", "zip": "75001"}},  # a nested model's field of the wrong type
    {**GOOD[0], "unit": "k"},  # not in the referenced enum
    {**GOOD[0], "tag": "far too long"},  # past the string branch's maxLength
    {**GOOD[0], "mode": "medium"},
]
USER = [{"role": "user", "content": "Plan it"}]


def _rendered_call(hf, args: dict) -> str:
    """The call as the checkpoint's template writes it (transformers), cut out of the conversation."""
    prefix = hf.apply_chat_template(USER, tokenize=False)
    call = {"id": "c", "type": "function", "function": {"name": "plan_trip", "arguments": args}}
    full = hf.apply_chat_template([*USER, {"role": "assistant", "content": None, "tool_calls": [call]}], tokenize=False)
    return full[len(prefix) :].removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")


def _accepts(hf, grammar: str, text: str) -> bool:
    import llguidance
    import llguidance.hf

    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(hf), llguidance.LLMatcher.grammar_from_lark(grammar))
    return m.consume_tokens(hf.encode(text, add_special_tokens=False)) and m.is_accepting()


def _parsed(fmt, text: str) -> list[tuple[str, str]]:
    p = ToolCallParser(fmt, [TOOL])
    calls: dict[int, list[str]] = {}
    for item in [*p.push(text), *p.flush()]:
        assert isinstance(item, ToolDelta), f"text outside the call: {item!r}"
        got = calls.setdefault(item.index, ["", ""])
        got[0] += item.name or ""
        got[1] += item.arguments
    return [(n, a) for n, a in calls.values()]


def test_the_references_are_valid_json_schema():
    for args in GOOD:
        jsonschema.validate(args, PARAMS)
    for args in BAD:
        assert not jsonschema.Draft202012Validator(PARAMS).is_valid(args), args


@pytest.mark.parametrize("choice", ["required", "named", "auto-strict"])
def test_xml_calls_the_template_writes_pass_the_grammar_and_parse_back(front, hf, choice):
    """A required, named or strict call's grammar compiles (the `$ref`s resolve), takes what the
    template writes for valid arguments, and the parser returns exactly those arguments."""
    tool, kw = TOOL, {}
    if choice == "named":
        kw["tool_choice"] = {"type": "function", "function": {"name": "plan_trip"}}
    elif choice == "required":
        kw["tool_choice"] = "required"
    else:
        tool = {"type": "function", "function": {**TOOL["function"], "strict": True}}
    body = {"model": "m", "messages": USER, "tools": [tool], "chat_template_kwargs": {"enable_thinking": False}, **kw}
    grammar = front.prepare(ChatRequest.model_validate(body)).constraint.grammar
    for args in GOOD:
        text = _rendered_call(hf, args)
        assert _accepts(hf, grammar, text), text
        ((name, arguments),) = _parsed("xml", text)
        assert name == "plan_trip" and json.loads(arguments) == args, (text, arguments)
    for args in BAD:
        assert not _accepts(hf, grammar, _rendered_call(hf, args)), args


def test_json_calls_with_references(hf):
    """The JSON call format embeds the arguments' schema in the call object's: its `$defs` go
    with it, so the references resolve."""
    from router.tool_choice import call_grammar

    grammar = call_grammar("json", [TOOL["function"]], many=False)

    def text(args: dict) -> str:
        return "<tool_call>\n" + json.dumps({"name": "plan_trip", "arguments": args}) + "\n</tool_call>"

    for args in GOOD:
        assert _accepts(hf, grammar, text(args)), args
        ((name, arguments),) = _parsed("json", text(args))
        assert name == "plan_trip" and json.loads(arguments) == args
    for args in BAD:
        assert not _accepts(hf, grammar, text(args)), args


@pytest.mark.parametrize(
    ("schema", "cases"),
    [
        ({"type": ["string", "null"]}, [('"Paris"', "Paris"), ("Paris", "Paris"), ("null", None), ("42", "42")]),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, [('"Paris"', "Paris"), ("null", None), ("42", "42")]),
        ({"type": ["integer", "string"]}, [('"high"', "high"), ("3", 3), ("3a", "3a")]),
        ({"type": ["string", "boolean"]}, [('"yes"', "yes"), ("true", True), ("5", "5")]),
        ({"type": ["string", "object"]}, [('{"a": 1}', {"a": 1}), ("5", "5"), ('"x"', "x")]),
    ],
    ids=["string-null", "anyOf-string-null", "integer-string", "string-boolean", "string-object"],
)
def test_a_union_with_string_converts_to_a_value_of_its_types(schema, cases):
    """A value of a union with a string, written as JSON (as a union's grammar has it written) or
    as bare text (the template's way, and a model's under `auto`), converts to a value of one of
    the declared types: never a string with its JSON quotes, never a type the schema leaves out."""
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"p": schema}}},
    }
    for written, want in cases:
        jsonschema.validate(want, schema)
        p = ToolCallParser("xml", [tool])
        text = f"<tool_call>\n<function=f>\n<parameter=p>\n{written}\n</parameter>\n</function>\n</tool_call>"
        args = "".join(i.arguments for i in [*p.push(text), *p.flush()] if isinstance(i, ToolDelta))
        assert json.loads(args) == {"p": want}, (written, args)


@pytest.mark.parametrize(
    ("name", "param", "field"),
    [
        ("a>b", "x", "tools[0].function.name"),
        ("get\nweather", "x", "tools[0].function.name"),
        (" spaced ", "x", "tools[0].function.name"),
        ("f", "x>y", "tools[0].function.parameters.properties"),
    ],
    ids=["gt-name", "newline-name", "blank-ends", "gt-parameter"],
)
def test_names_the_xml_format_cannot_carry_are_a_400(front, hf, name, param, field):
    """The template writes `<function=NAME>` and `<parameter=KEY>`: a name with `>`, a line break
    or blanks at its ends does not parse back as itself from the text the template writes (checked
    here), so the request is refused naming the field rather than answered with calls of another
    name and the rest of the call as content."""
    from router.openai_models import ApiError

    params = {"type": "object", "properties": {param: {"type": "string"}}, "required": [param]}
    prefix = hf.apply_chat_template(USER, tokenize=False)
    call = {"id": "c", "type": "function", "function": {"name": name, "arguments": {param: "v"}}}
    full = hf.apply_chat_template([*USER, {"role": "assistant", "content": None, "tool_calls": [call]}], tokenize=False)
    text = full[len(prefix) :].removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    tool = {"type": "function", "function": {"name": name, "parameters": params}}
    p = ToolCallParser("xml", [tool])
    items = [*p.push(text), *p.flush()]
    names = [i.name for i in items if isinstance(i, ToolDelta) and i.name is not None]
    args = "".join(i.arguments for i in items if isinstance(i, ToolDelta))
    assert names != [name] or json.loads(args or "null") != {param: "v"}, "the format carries it: no reason to refuse"
    for choice in ("auto", "required"):
        body = {"model": "m", "messages": USER, "tools": [tool], "tool_choice": choice}
        with pytest.raises(ApiError) as e:
            front.prepare(ChatRequest.model_validate(body))
        assert e.value.status == 400 and e.value.param == field, e.value.message
    body = {"model": "m", "messages": USER, "tools": [tool], "tool_choice": "none"}  # calls are not read
    front.prepare(ChatRequest.model_validate(body))
