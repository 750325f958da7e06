"""Structural tags compiled to Lark (engine/structured/struct_tag.py), run by llguidance's own
matcher byte by byte: which strings the grammar takes is compared with a direct scan of the
legacy semantics (tests/helpers/struct_tags.py), and xgrammar's format objects
with the strings its documentation gives; malformed tags are ValueErrors naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest

from engine.structured.spec import Constraint
from engine.structured.struct_tag import structural_tag_grammar
from tests.helpers.struct_tags import scan

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"utc": {"type": "boolean"}},
    "required": ["utc"],
    "additionalProperties": False,
}
LEGACY = {
    "type": "structural_tag",
    "structures": [
        {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
        {"begin": "<function=get_time>", "schema": TIME, "end": "</function>"},
        {"begin": "[[t]]", "schema": TIME, "end": ""},
    ],
    "triggers": ["<function=", "[["],
}


def accepts(tag, text: str) -> bool:
    g = llguidance.LLMatcher.grammar_from_lark(structural_tag_grammar(tag, "t"))
    m = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), g)
    assert not m.is_error(), m.get_error()
    return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()


def reference(tag: dict, text: str) -> bool:
    return scan(tag, text) is not None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "just text, no call",
        'I will check. <function=get_weather>{"city": "Paris"}</function> Done.',
        '<function=get_weather>{"city":"Oslo","days":3}</function><function=get_time>{"utc":true}</function>',
        'a [[t]]{"utc": false} b <function=get_time>{"utc":true}</function>\nend',
        "text ending in a half trigger <function",
        '<function=get_weather>{"city": 3}</function>',  # schema: city is a string
        '<function=get_weather>{"city": "x", "zip": 1}</function>',  # no other key
        '<function=get_time>{"utc": true}</func>',  # wrong end
        '<function=get_time>{"utc": true}',  # no end
        '<function=get_forecast>{"city": "x"}</function>',  # no such structure
        "free, then a trigger alone: <function=",
        "two [[ triggers",
        '<function=get_time>{"utc": true}</function> then <function=get_time>{}</function>',
        'é ünïcode [[t]]{"utc":true}',
    ],
)
def test_legacy_tag_takes_what_the_direct_scan_takes(text):
    assert accepts(LEGACY, text) == reference(LEGACY, text), text
    assert accepts(json.dumps(LEGACY), text) == reference(LEGACY, text)  # as vLLM's JSON text


def test_a_trigger_that_prefixes_another_reaches_every_structure_it_begins():
    tag = {
        "structures": [
            {"begin": "<f>", "schema": TIME, "end": "</f>"},
            {"begin": "<fun>", "schema": WEATHER, "end": "</fun>"},
        ],
        "triggers": ["<f", "<fun"],
    }
    for text in ('x <fun>{"city": "a"}</fun> <f>{"utc": true}</f>', 'x <fun>{"utc": true}</fun>', "<f"):
        assert accepts(tag, text) == reference(tag, text), text
    assert accepts(tag, 'x <fun>{"city": "a"}</fun>')


def test_a_begin_that_is_its_trigger_goes_straight_to_the_schema():
    name = {"type": "object", "properties": {"name": {"const": "f"}}, "required": ["name"]}
    tag = {"structures": [{"begin": "<tool_call>", "schema": name, "end": "</tool_call>"}], "triggers": ["<tool_call>"]}
    for text in ('a <tool_call>{"name": "f"}</tool_call> b', '<tool_call>{"name": "g"}</tool_call>', "<tool_call>"):
        assert accepts(tag, text) == reference(tag, text), text
    assert accepts(tag, '<tool_call>{"name": "f"}</tool_call>')


FN = {"type": "json_schema", "json_schema": WEATHER}


def tag(begin, content, end):
    return {"type": "tag", "begin": begin, "content": content, "end": end}


@pytest.mark.parametrize(
    "fmt,good,bad",
    [
        (
            {"type": "triggered_tags", "triggers": ["<function="], "tags": [tag("<function=w>", FN, "</function>")]},
            ['x <function=w>{"city": "P"}</function> y', "no call"],
            ["<function=v>{}</function>", '<function=w>{"city": 1}</function>'],
        ),
        (
            {
                "type": "triggered_tags",
                "triggers": ["<function="],
                "tags": [tag("<function=w>", FN, "</function>")],
                "at_least_one": True,
                "stop_after_first": True,
            },
            ['<function=w>{"city": "P"}</function>'],
            ["", "text first", '<function=w>{"city": "P"}</function> and more'],
        ),
        (
            {
                "type": "triggered_tags",
                "triggers": ["<t>"],
                "tags": [tag("<t>", {"type": "const_string", "value": "ok"}, "</t>")],
                "stop_after_first": True,
                "excludes": ["STOP"],
            },
            ["a <t>ok</t>", "plain"],
            ["a <t>ok</t> b", "a STOP", "<t>no</t>"],
        ),
        (
            {
                "type": "sequence",
                "elements": [
                    tag("<think>", {"type": "any_text"}, "</think>"),
                    {"type": "or", "elements": [{"type": "regex", "pattern": "[0-9]{2}"}, FN]},
                ],
            },
            ["<think>hmm</think>42", '<think></think>{"city": "P"}'],
            ["<think>a</think>b</think>42", "<think>x</think>4", "42"],
        ),
        (
            {
                "type": "tags_with_separator",
                "tags": [tag("<i>", {"type": "grammar", "grammar": "root ::= [0-9]+"}, ["</i>", "</I>"])],
                "separator": ",",
                "at_least_one": True,
            },
            ["<i>1</i>", "<i>12</I>,<i>3</i>"],
            ["", "<i>1</i>,", "<i>a</i>", "<i>1</i><i>2</i>"],
        ),
        (
            {"type": "repeat", "min": 1, "max": 2, "content": {"type": "const_string", "value": "ab"}},
            ["ab", "abab"],
            ["", "ababab"],
        ),
    ],
)
def test_format_objects(fmt, good, bad):
    for s in good:
        assert accepts({"type": "structural_tag", "format": fmt}, s), s
    for s in bad:
        assert not accepts({"type": "structural_tag", "format": fmt}, s), s


def test_json_in_a_tag_has_bounded_whitespace_as_every_schema():
    assert accepts(LEGACY, '[[t]]{\n  "utc": true\n}')
    assert not accepts(LEGACY, "[[t]]{" + " " * 40 + '"utc": true}')


def test_the_grammar_is_a_constraint_the_nodes_take():
    c = Constraint(kind="grammar", value=structural_tag_grammar(LEGACY, "t"))
    assert c.drafts_ok  # lazy lexemes roll back: drafts stay on


@pytest.mark.parametrize(
    "value,words",
    [
        ("{not json", "t is not JSON"),
        ([1], "t must be a JSON object"),
        ({"type": "json_schema"}, "t.type must be 'structural_tag'"),
        ({"type": "structural_tag"}, "needs 'structures' and 'triggers', or a 'format'"),
        ({"structures": [], "triggers": ["<"]}, "t.structures must be a non-empty list"),
        ({"structures": [{"begin": "<a>", "schema": {}}], "triggers": ["<"]}, "t.structures[0] needs 'end'"),
        ({"structures": [{"begin": "<a>", "schema": [], "end": ""}], "triggers": ["<"]}, "t.structures[0].schema"),
        ({"structures": [{"begin": 3, "schema": {}, "end": ""}], "triggers": ["<"]}, "t.structures[0].begin"),
        ({"structures": [{"begin": "<a>", "schema": {}, "end": ""}], "triggers": ["["]}, "starts with none"),
        ({"structures": [{"begin": "<a>", "schema": {}, "end": ""}], "triggers": ["<", "["]}, "t.triggers[1] '['"),
        ({"structures": [{"begin": "<a>", "schema": {}, "end": ""}], "triggers": [""]}, "t.triggers[0] must be"),
        ({"structures": [{"begin": "<a>", "schema": {}, "end": "", "x": 1}], "triggers": ["<"]}, "unknown field"),
        ({"format": {"type": "token", "token": 1}}, "t.format.type 'token' not supported"),
        ({"format": {"type": "sequence", "elements": [{"type": "any_text"}, FN]}}, "any_text must end"),
        ({"format": {"type": "json_schema", "json_schema": {}, "style": "qwen_xml"}}, "t.format.style"),
        ({"format": {"type": "tag", "begin": "<a>", "content": FN}}, "t.format needs 'end'"),
        ({"format": {"type": "const_string", "value": "a", "extra": 1}}, "t.format: unknown field(s) extra"),
        ({"format": {"type": "repeat", "min": 2, "max": 1, "content": FN}}, "t.format.max (1) is below min"),
        ({"format": {"type": "grammar", "grammar": "root ::= ("}}, "t.format.grammar"),
        (
            {"format": {"type": "or", "elements": [FN, {"type": "triggered_tags", "triggers": ["<"], "tags": []}]}},
            "t.format.elements[1].tags must be a non-empty list",
        ),
    ],
)
def test_malformed_tags_name_the_field(value, words):
    with pytest.raises(ValueError) as e:
        structural_tag_grammar(value, "t")
    assert words in str(e.value), str(e.value)


def test_rolled_back_matcher_masks_as_a_fresh_one():
    """Drafts stay on for a structural tag (its lazy lexemes roll back): after consuming three
    bytes past each point and rolling them back, the matcher's mask equals that of a matcher fed
    only up to that point, in free text, inside a tag and after it."""
    text = b'ok <function=get_time>{"utc": true}</function> x [[t]]{"utc":false}'
    grammar = llguidance.LLMatcher.grammar_from_lark(structural_tag_grammar(LEGACY, "t"))
    tok = llguidance.LLTokenizer("byte")
    for i in range(len(text) - 3):
        fresh, drafted = llguidance.LLMatcher(tok, grammar), llguidance.LLMatcher(tok, grammar)
        assert fresh.consume_tokens(list(text[:i])) and drafted.consume_tokens(list(text[: i + 3]))
        assert drafted.rollback(3)
        assert drafted.compute_logit_bias() == fresh.compute_logit_bias(), i


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny checkpoint's tokenizer (Qwen's layout: `<think>`, `<tool_call>` are added tokens)."""
    from engine.tiny_model import TinyModelSpec
    from engine.tokenizer import Tokenizer
    from tests.helpers import hybrid_ckpt as hc

    path = hc.make(tmp_path_factory.mktemp("tag") / "ckpt", TinyModelSpec(layers=1))
    return Tokenizer(path), llguidance.LLTokenizer((Path(path) / "tokenizer.json").read_text())


def test_an_added_token_in_a_tag_matches_the_token_or_its_spelling(tiny):
    """llguidance reads `<tool_call>` (an added token) as a special token, never as text: given
    the tokenizer's added tokens, a trigger, begin or end that holds one takes the token (as the
    model writes it) or its spelling; without them the token is refused."""
    tok, llt = tiny
    tag = {
        "structures": [{"begin": "<tool_call>\n", "schema": TIME, "end": "\n</tool_call>"}],
        "triggers": ["<tool_call>"],
    }
    think = {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}
    fmt = {"format": {"type": "sequence", "elements": [think, {"type": "const_string", "value": "ok"}]}}

    def takes(t, ids, specials) -> bool:
        m = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(structural_tag_grammar(t, "t", specials)))
        assert not m.is_error(), m.get_error()
        return all(m.consume_token(i) for i in ids) and m.is_accepting()

    call = 'hi <tool_call>\n{"utc": true}\n</tool_call> ok'
    as_model = tok.encode(call)  # the added tokens' ids
    assert tok.added_tokens["<tool_call>"] in as_model and tok.added_tokens["</tool_call>"] in as_model
    spelled = [i for piece in call.split("<") for i in [*tok.encode(piece), *tok.encode("<")]][: -len(tok.encode("<"))]
    assert tok.decode(spelled) == call
    assert tok.added_tokens["<tool_call>"] not in spelled
    assert takes(tag, as_model, tok.added_tokens) and takes(tag, spelled, tok.added_tokens)
    assert not takes(tag, tok.encode('hi <tool_call>\n{"utc": 1}\n</tool_call>'), tok.added_tokens)
    assert not takes(tag, as_model, {})
    thought = tok.encode("<think>hmm</think>ok")
    assert takes(fmt, thought, tok.added_tokens) and not takes(fmt, thought, {})
