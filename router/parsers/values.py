"""A tool call's parameter values, written as text by the XML call format, converted to JSON
values by the type the tool's JSON schema declares for that parameter."""

from __future__ import annotations

import json
import math
from typing import Any


def param_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """function name -> {parameter name: its schema}, from OpenAI's `tools`."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or ():
        f = t.get("function") if isinstance(t, dict) else None
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            props = (f.get("parameters") or {}).get("properties")
            out[f["name"]] = props if isinstance(props, dict) else {}
    return out


def _types(schema: Any) -> list[str]:
    t = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list):
        return sorted({"string" if isinstance(v, str) else "json" for v in schema["enum"]})
    return []


def is_text(schema: Any) -> bool:
    """Whether the value is a string whatever its text (streamed as it comes): declared a string,
    or not declared (a parameter the schema does not name is text, as the format writes it)."""
    ts = _types(schema)
    return ts == ["string"] or (schema is None)


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


def convert(text: str, schema: Any) -> Any:
    """The JSON value of a parameter's text under its schema; the text itself when it does not
    parse as the declared type."""
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
        if t in ("json", "object", "array", "number", "integer"):
            return v
    return text
