"""A Constraint's (kind, value) -> the llguidance grammar text a matcher compiles, and the check
that refuses a bad one without a tokenizer (so the router and both node kinds can validate).

JSON (json_schema, json_object) is compiled with bounded whitespace between tokens: one blank or
none, or a newline and an indentation of at most INDENT_MAX blanks, so a weak model cannot loop
on whitespace while pretty-printed output stays possible, unless the schema's own `x-guidance`
fixes its whitespace: `"whitespace_flexible": false` (compact JSON, `,` and `:` with no blank, as
vLLM's `disable_any_whitespace` asks) or a `whitespace_pattern` of its own. `choice` is a Lark
alternative of JSON-quoted literals; `grammar` is passed through (llguidance's Lark dialect): a
schema it embeds with `%json` bounds its whitespace only if it says so (`bounded_json` adds it)."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

INDENT_MAX = 16  # blanks after a newline between two JSON tokens, at most
WHITESPACE = rf"(?:\x20?|\x0A\x20{{0,{INDENT_MAX}}})"
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": WHITESPACE}


def bounded_json(schema: dict[str, object]) -> dict[str, object]:
    """A JSON schema to embed in a Lark grammar (`%json {...}`) with the same bounded whitespace
    as json_schema constraints (an embedded schema otherwise gets llguidance's unbounded default);
    one whose `x-guidance` fixes its whitespace already (`own_whitespace`) is left as it is."""
    if own_whitespace(schema):
        return schema
    return {**schema, "x-guidance": {**_x_guidance(schema), "whitespace_pattern": WHITESPACE}}


def own_whitespace(schema: object) -> bool:
    """Whether a schema's `x-guidance` says how its JSON is spaced: compact
    (`"whitespace_flexible": false`) or a `whitespace_pattern` of its own."""
    x = _x_guidance(schema) if isinstance(schema, dict) else {}
    return x.get("whitespace_flexible") is False or "whitespace_pattern" in x


def _x_guidance(schema: dict[str, object]) -> dict[str, object]:
    x = schema.get("x-guidance")
    return dict(x) if isinstance(x, dict) else {}


@functools.lru_cache(maxsize=256)
def grammar_text(kind: str, value: str | tuple[str, ...]) -> str:
    """The llguidance grammar for (kind, value); ValueError if the value is not even well formed."""
    M = llguidance.LLMatcher
    if kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
    if kind == "json_schema":
        assert isinstance(value, str)
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"json_schema must be a JSON object (got {type(schema).__name__})")
        try:
            return M.grammar_from_json_schema(value, overrides=None if own_whitespace(schema) else _JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"json_schema: {e}") from None
    if kind == "regex":
        assert isinstance(value, str)
        return M.grammar_from_regex(value)
    if kind == "grammar":
        assert isinstance(value, str)
        return M.grammar_from_lark(value)
    if kind == "choice":
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    raise ValueError(f"unknown constraint kind {kind!r}")


@functools.lru_cache(maxsize=256)
def check(kind: str, value: str | tuple[str, ...]) -> None:
    """ValueError naming the problem if (kind, value) does not compile (cached: the router and
    the nodes check the same request)."""
    err = llguidance.LLMatcher.validate_grammar(grammar_text(kind, value))
    if err:
        raise ValueError(f"invalid {kind} constraint: {err.strip()}")
