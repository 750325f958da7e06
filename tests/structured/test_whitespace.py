"""JSON whitespace as the grammar allows it: bounded by default (one blank or none, or a newline
and up to 16 blanks), compact when the schema's `x-guidance` says `whitespace_flexible: false`
(vLLM's disable_any_whitespace), the schema's own `whitespace_pattern` when it has one; the same
whether the schema is a json_schema constraint or embedded in a Lark grammar (`bounded_json`).
Checked byte by byte with llguidance's byte tokenizer against Python's own reading of each text."""

from __future__ import annotations

import json

import llguidance
import pytest

from engine.structured.grammar import bounded_json, grammar_text

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}},
}
OBJ = {"a": 1, "b": [2, 3]}
TEXTS = {
    "compact": json.dumps(OBJ, separators=(",", ":")),
    "spaced": json.dumps(OBJ),
    "indented": json.dumps(OBJ, indent=2),
    "deep": json.dumps(OBJ, indent=20),  # more blanks after a newline than the bound
}


def _accepts(grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), grammar, log_level=0)
    return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()


def _as_constraint(schema: dict) -> str:
    return grammar_text("json_schema", json.dumps(schema))


def _embedded(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_lark('start: "=" x\nx: %json ' + json.dumps(bounded_json(schema)))


@pytest.mark.parametrize("compile_", [_as_constraint, _embedded], ids=["json_schema", "embedded"])
@pytest.mark.parametrize(
    "x_guidance,allowed",
    [
        (None, {"compact", "spaced", "indented"}),
        ({"whitespace_flexible": False}, {"compact"}),
        ({"whitespace_pattern": r"\x20?"}, {"compact", "spaced"}),
    ],
    ids=["bounded", "compact", "own-pattern"],
)
def test_whitespace_follows_the_schema(compile_, x_guidance, allowed):
    schema = dict(SCHEMA, **({"x-guidance": x_guidance} if x_guidance else {}))
    g = compile_(schema)
    prefix = "=" if compile_ is _embedded else ""
    for name, text in TEXTS.items():
        assert json.loads(text) == OBJ
        assert _accepts(g, prefix + text) == (name in allowed), (name, text)
