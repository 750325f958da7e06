"""The structured-output fields of a chat or completions body -> one proto `Constraint`.

Clients write the same constraint several ways, and each is read here rather than ignored (an
ignored field would return unconstrained text that looks like an answer):
- OpenAI's `response_format` (`json_object`, `json_schema`), on chat and on completions, and
  vLLM's and SGLang's `structural_tag` type there (engine/structured/struct_tag.py);
- vLLM's `structured_outputs` object: exactly one of `json` (a schema, object or JSON text),
  `regex`, `choice` (a list of strings), `grammar`, `json_object` (true), `structural_tag` (the
  same tag as its JSON text); its JSON options
  `disable_any_whitespace` (compact JSON), `whitespace_pattern` and
  `disable_additional_properties` (objects take only the properties they name) shape a JSON
  constraint, its own or one another field names (`response_format`, as vLLM merges them);
  `disable_fallback` changes nothing (one backend);
- vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, with
  `guided_whitespace_pattern` and `guided_decoding_backend`'s options (`xgrammar:disable-any-whitespace`,
  `guidance:no-additional-properties`; the backend's name itself changes nothing);
- SGLang's top-level `regex`, `ebnf` and `json_schema` (a schema's JSON text or object).
A grammar is llguidance's Lark dialect or GBNF (llama.cpp's and xgrammar's `root ::= ...`),
converted to Lark here. Two fields naming constraints at once are a 400 naming both."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.structured.grammar import bounded_json
from engine.structured.spec import Constraint
from engine.structured.struct_tag import structural_tag_grammar
from proto import pb
from proto.convert import constraint_kwargs
from router import json_shape
from router.openai_models import ApiError, bad

EMPTY: Mapping[str, int] = {}  # no added tokens known (no tokenizer on the router)
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's structured_outputs options: those that shape a JSON constraint (json_shape.py), and one
# that changes nothing here (the engine has one backend, no fallback to choose)
JSON_OPTION_KEYS = ("disable_any_whitespace", "whitespace_pattern", "disable_additional_properties")
IGNORED_KEYS = ("disable_fallback",)
# top-level fields naming a constraint of one kind: vLLM's older ones, then SGLang's
TOP_LEVEL = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
    ("regex", "regex"),
    ("ebnf", "grammar"),
    ("json_schema", "json"),
)


def constraint(req: Any) -> pb.Constraint | None:
    """The request's constraint (None: free text); ApiError 400 naming the field that is wrong."""
    found: list[tuple[str, pb.Constraint]] = []
    specials = req.special_tokens
    c = response_format(req.response_format, req.format_field, specials)
    if c is not None:
        found.append((req.format_field, c))
    for name, kind in TOP_LEVEL:
        v = getattr(req, name)
        if v is not None:
            found.append((name, _one(name, kind, v)))
    so = req.structured_outputs
    if so is not None and (c := _structured(so, alone=not found, specials=specials)) is not None:
        found.insert(1 if found and found[0][0] == req.format_field else 0, ("structured_outputs", c))
    if len(found) > 1:
        a, b = found[0][0], found[1][0]
        raise bad(f"'{a}' and '{b}' both constrain the output: send one", b)
    if not found:
        return None
    param, c = found[0]
    options = json_shape.options(req)
    if options is not None:
        c = json_shape.shaped(c, options)
    return checked(param, c)


def checked(param: str, c: pb.Constraint) -> pb.Constraint:
    """`c`, or a 400 naming `param` when it does not compile (a schema's unknown type, a bad
    regex or grammar), rather than the nodes' refusal of the grammar it became."""
    try:
        Constraint.from_value(constraint_kwargs(c))  # the engine's own check, as the nodes run it
    except ValueError as e:
        raise bad(f"'{param}': {e}", param) from None
    return c


def check_schema(param: str, schema: Any) -> None:
    """A 400 naming `param` when the JSON schema (a tool's parameters) does not compile."""
    checked(param, pb.Constraint(json_schema=json.dumps(schema)))


def response_format(
    rf: Any, param: str = "response_format", specials: Mapping[str, int] = EMPTY
) -> pb.Constraint | None:
    """OpenAI's `response_format`: text (None), json_object, json_schema or structural_tag;
    `param`: where the client's body has it (Responses' `text.format`), named in a 400;
    `specials`: the checkpoint's added tokens' texts and ids (a structural tag's strings may be tokens)."""
    if rf in (None, {}) or isinstance(rf, dict) and rf.get("type") == "text":
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "json_object":
        return pb.Constraint(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            shape = "'schema': {...}" if param != "response_format" else "'json_schema': {'name': ..., 'schema': {...}}"
            raise bad(f"{param} json_schema needs {shape}", param)
        return pb.Constraint(json_schema=json.dumps(schema))
    if kind == "structural_tag":
        return _structural_tag(param, rf, specials)
    raise ApiError(
        400, f"{param} type must be text, json_object, json_schema or structural_tag (got {kind!r})", param=param
    )


def _structured(so: Any, alone: bool, specials: Mapping[str, int]) -> pb.Constraint | None:
    """The constraint `structured_outputs` names; None when it holds JSON options alone and
    `alone` is false (they shape the constraint another field names)."""
    if not isinstance(so, dict):
        raise bad(
            f"'structured_outputs' must be an object with one of {', '.join(STRUCTURED_KEYS)}", "structured_outputs"
        )
    unknown = sorted(k for k in so if k not in (*STRUCTURED_KEYS, *JSON_OPTION_KEYS, *IGNORED_KEYS))
    if unknown:
        raise bad(
            f"'structured_outputs' {', '.join(unknown)} not supported (supported: {', '.join(STRUCTURED_KEYS)})",
            "structured_outputs",
        )
    named = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if not named and not alone:
        return None
    if len(named) != 1:
        raise bad(
            f"'structured_outputs' needs exactly one of {', '.join(STRUCTURED_KEYS)} (got {len(named)})",
            "structured_outputs",
        )
    return _one(f"structured_outputs.{named[0]}", named[0], so[named[0]], specials)


def _one(param: str, kind: str, v: Any, specials: Mapping[str, int] = EMPTY) -> pb.Constraint:
    """One constraint of `kind` (json, regex, choice, grammar, json_object, structural_tag) from
    the value the client sent under `param`."""
    if kind == "structural_tag":
        return _structural_tag(param, v, specials)
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise bad(f"'{param}' is not JSON: {e}", param) from None
        if not isinstance(v, dict):
            raise bad(f"'{param}' must be a JSON schema object (got {type(v).__name__})", param)
        return pb.Constraint(json_schema=json.dumps(v))
    if kind == "json_object":
        if v is not True:
            raise bad(f"'{param}' must be true (got {v!r})", param)
        return pb.Constraint(json_object=True)
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(s, str) for s in v):
            raise bad(f"'{param}' must be a non-empty list of strings", param)
        return pb.Constraint(choice=pb.ChoiceList(choices=v))
    if not isinstance(v, str) or not v.strip():
        raise bad(f"'{param}' must be a non-empty string", param)
    if kind == "regex":
        return pb.Constraint(regex=v)
    return pb.Constraint(grammar=_lark(param, v))


def _structural_tag(param: str, tag: Any, specials: Mapping[str, int]) -> pb.Constraint:
    """A structural tag (its JSON text or object) as the grammar it compiles to."""
    try:
        return pb.Constraint(grammar=structural_tag_grammar(tag, param, specials))
    except ValueError as e:
        raise bad(str(e), param) from None


def _lark(param: str, text: str) -> str:
    """A grammar in llguidance's Lark dialect; GBNF (`name ::= ...` rules) is converted."""
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax  # noqa: PLC0415 (the router's only use)

    if is_lark_syntax(text):
        return text
    try:
        return gbnf_to_lark(text)
    except Exception as e:  # noqa: BLE001 (the converter raises its own error types)
        raise bad(f"'{param}' is neither a Lark grammar nor GBNF that converts to one: {e}", param) from None


ANY = "<[*]>*"  # any tokens: no constraint of its own


def as_lark(c: pb.Constraint | None) -> str:
    """A constraint as a Lark expression to nest in a larger grammar (a thinking budget's answer,
    a custom tool's input)."""
    kind = c.WhichOneof("kind") if c is not None else None
    if c is None or kind is None:
        return ANY
    if kind == "json_object":
        return "%json " + json.dumps(bounded_json({"type": "object"}))
    if kind == "json_schema":
        return "%json " + json.dumps(bounded_json(json.loads(c.json_schema)))
    if kind == "regex":
        return "/" + c.regex.replace("/", "\\/") + "/"
    if kind == "choice":
        return "(" + " | ".join(json.dumps(s) for s in c.choice.choices) + ")"
    return "%lark {\n" + c.grammar + "\n}"
