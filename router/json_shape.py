"""The JSON options of vLLM's structured outputs, applied to a JSON constraint's schema.

vLLM's clients shape JSON output with `structured_outputs` options (`disable_any_whitespace`,
`whitespace_pattern`, `disable_additional_properties`), the older `guided_whitespace_pattern`,
and options after the backend's name in `guided_decoding_backend` (`xgrammar:disable-any-whitespace`,
`guidance:no-additional-properties`). Each becomes part of the schema the engine compiles:
compact JSON and a whitespace pattern as the schema's `x-guidance` (engine/structured/grammar.py
honours it), closed objects as `additionalProperties: false` on every object schema that does
not say. Regex, choice and grammar constraints are left as they are (the options are JSON's)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from proto import pb
from router.openai_models import bad

# guided_decoding_backend options (after `name:`, comma-separated) that shape JSON
BACKEND_COMPACT = "disable-any-whitespace"
BACKEND_CLOSED = "no-additional-properties"


@dataclass(frozen=True)
class JsonShape:
    compact: bool = False  # no whitespace at all between JSON tokens
    whitespace_pattern: str | None = None  # the regex of whitespace between JSON tokens
    closed: bool = False  # objects take only the properties they name


def options(req: Any) -> JsonShape | None:
    """The request's JSON options (None: none asked for); ApiError 400 naming a malformed one."""
    so = req.structured_outputs if isinstance(req.structured_outputs, dict) else {}
    compact = _flag(so, "disable_any_whitespace")
    closed = _flag(so, "disable_additional_properties")
    pattern = _pattern("structured_outputs.whitespace_pattern", so.get("whitespace_pattern"))
    top = _pattern("guided_whitespace_pattern", req.guided_whitespace_pattern)
    if pattern is not None and top is not None and pattern != top:
        raise bad(
            "'guided_whitespace_pattern' and 'structured_outputs.whitespace_pattern' differ: send one",
            "guided_whitespace_pattern",
        )
    pattern = pattern if pattern is not None else top
    backend = req.guided_decoding_backend
    if backend is not None:
        if not isinstance(backend, str):
            raise bad(
                f"'guided_decoding_backend' must be a string (got {type(backend).__name__})", "guided_decoding_backend"
            )
        opts = {o.strip() for o in backend.partition(":")[2].split(",")}
        compact |= BACKEND_COMPACT in opts
        closed |= BACKEND_CLOSED in opts
    if compact and pattern is not None:
        raise bad(
            "'disable_any_whitespace' and a 'whitespace_pattern' both set the JSON whitespace: send one",
            "structured_outputs",
        )
    if not (compact or closed or pattern is not None):
        return None
    return JsonShape(compact=compact, whitespace_pattern=pattern, closed=closed)


def shaped(c: pb.Constraint, shape: JsonShape) -> pb.Constraint:
    """`c` with `shape` applied when it is JSON (json_schema, json_object); else `c`."""
    kind = c.WhichOneof("kind")
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        schema = json.loads(c.json_schema)
    else:
        return c
    if not isinstance(schema, dict):
        return c
    if shape.closed:
        schema = closed(schema)
    x = schema.get("x-guidance")
    x = dict(x) if isinstance(x, dict) else {}
    if shape.compact:
        x["whitespace_flexible"] = False
    if shape.whitespace_pattern is not None:
        x["whitespace_pattern"] = shape.whitespace_pattern
    if x:
        schema = {**schema, "x-guidance": x}
    return pb.Constraint(json_schema=json.dumps(schema))


# keywords whose value is a map of names to schemas, one schema, or a list of schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema in it (one with
    `properties` or `type` object) that says nothing of additional properties. Walks the
    keywords that hold schemas only, never a `const`, `enum` or `default` value."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed(s) for name, s in out[k].items()}
    for k in _SCHEMA_ONE:
        if isinstance(out.get(k), dict):
            out[k] = closed(out[k])
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [closed(s) for s in out[k]]
    t = out.get("type")
    is_object = "properties" in out or t == "object" or (isinstance(t, list) and "object" in t)
    if is_object and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _flag(so: dict[str, Any], key: str) -> bool:
    v = so.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'structured_outputs.{key}' must be true or false (got {v!r})", f"structured_outputs.{key}")
    return v


def _pattern(param: str, v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad(f"'{param}' must be a regex string (got {type(v).__name__})", param)
    return v
