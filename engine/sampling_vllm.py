"""vLLM's spellings of `SamplingParams` fields, as scripts moved from `vllm.SamplingParams` write
them, read into pdserve's: `max_tokens=None` (as many as the context leaves), `stop` as one
string, `structured_outputs=StructuredOutputsParams(...)` (or the older
`guided_decoding=GuidedDecodingParams(...)`) as the request's constraint; vLLM fields pdserve does
not have are refused by name (docs/engine.md, "engine/llm.py")."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from engine.json_text import json_value

# max_tokens None: as many as max_model_len leaves (the engine ends the request there, "length")
UNBOUNDED_TOKENS = 2**31 - 1
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's options that change what a JSON constraint allows: applied on the served route only
JSON_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
# vLLM's SamplingParams fields pdserve has no counterpart for, and what to use instead
NOT_SUPPORTED = {
    "allowed_token_ids": "logit_bias (up to 300 ids) or structured_outputs",
    "bad_words": "logit_bias with -100 on the words' tokens",
    "best_of": "n",
    "logits_processors": "logit_bias or structured_outputs",
    "truncate_prompt_tokens": "cutting the prompt's token ids before generate",
    "output_kind": "generate's whole outputs",
    "extra_args": "the named fields",
}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one of json (a schema as a dict or its JSON text),
    regex, choice (strings), grammar (Lark, or GBNF rules), json_object=True, structural_tag (its
    JSON text, engine/structured/struct_tag.py). `backend` and
    `disable_fallback` are accepted and unused (one backend)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    backend: str | None = None


GuidedDecodingParams = StructuredOutputsParams  # vLLM's name for it before 0.10.2


def vllm_forms(kwargs: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams' keyword arguments with vLLM's spellings read as pdserve's (module docstring)."""
    bad = sorted(k for k in kwargs if k in NOT_SUPPORTED and kwargs[k] not in (None, [], {}))
    if bad:
        use = "; ".join(f"{k}: use {NOT_SUPPORTED[k]}" for k in bad)
        raise ValueError(f"{', '.join(bad)} not supported ({use})")
    out = {k: v for k, v in kwargs.items() if k not in NOT_SUPPORTED}
    if "max_tokens" in out and out["max_tokens"] is None:
        out["max_tokens"] = UNBOUNDED_TOKENS
    given = [k for k in ("structured_outputs", "guided_decoding", "constraint") if out.get(k) is not None]
    if len(given) > 1:
        raise ValueError(f"give one of {', '.join(given)}, not several")
    for name in ("structured_outputs", "guided_decoding"):
        so = out.pop(name, None)
        if so is not None:
            out["constraint"] = structured_constraint(so, name)
    return out


def structured_constraint(so: Any, name: str = "structured_outputs") -> dict[str, Any]:
    """vLLM's StructuredOutputsParams (pdserve's, vLLM's own object or a dict of its fields) as a
    {kind, value} constraint mapping (engine/structured/spec.py checks the value)."""
    if isinstance(so, dict):
        known = {f.name for f in fields(StructuredOutputsParams)}
        unknown = sorted(set(so) - known)
        if unknown:
            raise ValueError(f"{name}: unknown field(s) {', '.join(unknown)}")
        so = {k: so.get(k) for k in known}
    else:  # pdserve's or vLLM's own object: read by field name
        so = {f.name: getattr(so, f.name, None) for f in fields(StructuredOutputsParams)}
    get = so.get
    opts = [k for k in JSON_OPTIONS if get(k) not in (None, False)]
    if opts:
        raise ValueError(f"{name}.{opts[0]} is not supported by the offline LLM (the served route applies it)")
    named = [k for k in STRUCTURED_KINDS if get(k) not in (None, False)]
    if len(named) != 1:
        raise ValueError(f"{name} needs exactly one of {', '.join(STRUCTURED_KINDS)} (got {len(named)})")
    kind, v = named[0], get(named[0])
    where = f"{name}.{kind}"
    if kind == "json":
        v = json_value(v, where)
        if not isinstance(v, dict):
            raise ValueError(f"{where} must be a JSON schema object (got {type(v).__name__})")
        return {"kind": "json_schema", "value": json.dumps(v)}
    if kind == "json_object":
        if v is not True:
            raise ValueError(f"{where} must be True (got {v!r})")
        return {"kind": "json_object"}
    if kind == "choice":
        if not isinstance(v, list | tuple) or not v or not all(isinstance(s, str) for s in v):
            raise ValueError(f"{where} must be a non-empty list of strings")
        return {"kind": "choice", "value": tuple(v)}
    if kind == "structural_tag":
        from engine.structured.struct_tag import structural_tag_grammar  # noqa: PLC0415 (as a grammar's import)

        return {"kind": "grammar", "value": structural_tag_grammar(v, where)}
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"{where} must be a non-empty string")
    if kind == "regex":
        return {"kind": "regex", "value": v}
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax  # noqa: PLC0415 (only a grammar needs it)

    return {"kind": "grammar", "value": v if is_lark_syntax(v) else gbnf_to_lark(v)}


def stop_strings(stop: Any) -> tuple[str, ...]:
    """`stop` as a tuple of strings (vLLM takes one string or a list); ValueError otherwise."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings (got {stop!r})")
    return tuple(stop)


def check_output_options(p: Any) -> None:
    """ValueError naming the field for a bad n, a flag that is not a bool, or stop strings asked
    of an output that is not detokenized."""
    if not isinstance(p.n, int) or isinstance(p.n, bool) or p.n < 1:
        raise ValueError(f"n must be a positive integer (got {p.n!r})")
    for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
        if not isinstance(getattr(p, name), bool):
            raise ValueError(f"{name} must be true or false (got {getattr(p, name)!r})")
    if p.stop and not p.detokenize:
        raise ValueError("stop strings need detokenize=True (they are matched on the text)")
