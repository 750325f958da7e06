"""A tool call's parameter values, written as text by the XML call format, converted to JSON
values by the type the tool's JSON schema declares for that parameter.

A parameter's schema is read as agents' tool definitions write it: a `$ref` into the parameters'
`$defs` (or `definitions`), as pydantic writes nested models and enums, is followed, and so are
those of `anyOf` / `oneOf` branches, whose types together are the parameter's (`Optional[str]` is
`anyOf: [{"type": "string"}, {"type": "null"}]`). What `is_text` and `nullable_text` say is also
how the call grammar (router/tool_choice.py) lets the value be written, so a constrained value
always converts back to what its schema allows."""

from __future__ import annotations

import json
import math
from typing import Any


def param_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """function name -> {parameter name: its schema, references followed}, from OpenAI's `tools`."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or ():
        f = t.get("function") if isinstance(t, dict) else None
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            params = f.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            props = props if isinstance(props, dict) else {}
            out[f["name"]] = {k: resolve(v, params) for k, v in props.items()}
    return out


def _follow(schema: Any, root: Any) -> Any:
    """`schema` with a local `$ref` (`#/$defs/Name`, any JSON pointer into `root`) replaced by its
    target, the referring schema's other keys kept; a few hops at most, an unknown target left."""
    for _ in range(8):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return schema
        target = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            return schema
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def resolve(schema: Any, root: Any) -> Any:
    """`schema` and its `anyOf` / `oneOf` branches with their local `$ref`s followed (one level:
    what a parameter's types are read from); nested schemas are left as they are."""
    s = _follow(schema, root)
    if isinstance(s, dict):
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list):
                s = {**s, key: [_follow(b, root) for b in s[key]]}
    return s


def _types(schema: Any) -> list[str]:
    t = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list):
        return sorted({"string" if isinstance(v, str) else "json" for v in schema["enum"]})
    branches = schema.get("anyOf", schema.get("oneOf")) if isinstance(schema, dict) else None
    if isinstance(branches, list) and branches:
        out: list[str] = []
        for b in branches:
            bt = _types(b)
            if not bt:  # a branch of any type: so is the value
                return []
            out += [x for x in bt if x not in out]
        return out
    return []


def is_text(schema: Any) -> bool:
    """Whether the value is a string whatever its text (streamed as it comes): declared a string,
    or not declared (a parameter the schema does not name is text, as the format writes it)."""
    ts = _types(schema)
    return ts == ["string"] or (schema is None)


def nullable_text(schema: Any) -> dict[str, Any] | None:
    """The string schema of a parameter that is a string or null (`"type": ["string", "null"]`,
    or `anyOf` a string and null), written as the template writes it: the string as it is, or
    `null`; None for any other schema, or one whose string is an enum or a constant."""
    if not isinstance(schema, dict) or sorted(_types(schema)) != ["null", "string"]:
        return None
    branches = schema.get("anyOf", schema.get("oneOf"))
    if not isinstance(schema.get("type"), list) and isinstance(branches, list):
        strings = [b for b in branches if isinstance(b, dict) and _types(b) == ["string"]]
        s = strings[0] if len(strings) == 1 else None
    else:
        s = schema
    if s is None or "enum" in s or "const" in s:
        return None
    return s


class RawFloat(float):
    """A JSON number as the model wrote it: `dumps_exact` writes its text back (1e+3997 stays
    that, where a float would be Infinity, which is no JSON)."""

    text: str

    def __new__(cls, text: str) -> RawFloat:
        f = super().__new__(cls, text)
        f.text = text
        return f


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_exact(s: str) -> Any:
    """json.loads, numbers kept as written (RawFloat) and NaN / Infinity refused (ValueError)."""
    return json.loads(s, parse_float=RawFloat, parse_constant=_no_constant)


def dumps_exact(v: Any) -> str:
    """json.dumps (its separators, non-ASCII kept) with each RawFloat written as its text."""
    if isinstance(v, RawFloat):
        return v.text
    if isinstance(v, dict):
        return "{" + ", ".join(json.dumps(k, ensure_ascii=False) + ": " + dumps_exact(x) for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(dumps_exact(x) for x in v) + "]"
    return json.dumps(v, ensure_ascii=False)


def _never(v: Any) -> bool:
    return False


_IS = {
    "string": lambda v: isinstance(v, str),
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def convert(text: str, schema: Any) -> Any:
    """The JSON value of a parameter's text under its schema; the text itself when it does not
    parse as the declared type. A JSON value of one of several declared types is that value (a
    `["string", "boolean"]` parameter written `"yes"` is the string yes, not the text with its
    quotes)."""
    ts = _types(schema)
    s = text.strip()
    for t in ts or ["json"]:
        if t == "string":
            continue
        if t == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true"
        if t == "null" and s.lower() in ("null", "none"):
            return None
        if t in ("integer", "number"):
            try:
                return int(s)
            except ValueError:
                pass
        try:
            v = loads_exact(s)
        except ValueError:
            continue
        if t == "integer" and isinstance(v, float) and math.isfinite(v) and v.is_integer():
            return int(v)
        if t == "json" or _IS.get(t, _never)(v) or (len(ts) == 1 and t in ("object", "array", "number", "integer")):
            return v  # of a union, only a value of the type tried
    if len(ts) > 1:
        try:
            v = loads_exact(s)
        except ValueError:
            return text
        if any(_IS.get(t, _never)(v) for t in ts):
            return v
    return text
