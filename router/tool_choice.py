"""`tools`, `tool_choice` and the output constraint (router/structured_fields.py) of a chat request ->
what the router does with the output: whether calls are parsed, and the Constraint (proto
`Constraint`) the decoding obeys.

`tool_choice` `none`: calls are not parsed (the text stays content); `auto` (the default with
tools): calls are parsed; `required`: at least one call (exactly one with `parallel_tool_calls`
false); a named function: exactly one call of it. `required` and named calls are enforced by a Lark
grammar (llguidance's dialect) of the checkpoint's call format whose values follow each tool's
parameter schema: in the XML format a string parameter is text without `</`, an enum one of its
strings, any other a JSON value of its schema (`%json`); required parameters in the schema's order,
optional ones may follow in that order (in the JSON format, the arguments object has no parameter
its schema does not name, unless the schema says `additionalProperties`); a custom tool's `input`
follows its own Lark or regex grammar (router/custom_tools.py); the other constraints
(`response_format` and the like) exclude them. Under `auto`, when a function tool is `strict: true`
or a custom tool has a grammar, the output is free text (no special tokens) then optionally calls
under the same grammar, unless another constraint is set. `allowed_tools` keeps every tool in the
prompt and limits the calls (`required` or `auto`, both enforced) to the tools it lists. With the
template's think block open in the prompt the constraint starts after `</think>`
(`start_after_token`), so the reasoning stays free."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.structured.grammar import bounded_json
from proto import pb
from router import structured_fields
from router.custom_tools import INPUT, CustomTool
from router.openai_models import ChatRequest, bad
from router.parsers.tool_calls import ToolFormat
from router.parsers.values import is_text, nullable_text, resolve


@dataclass(frozen=True)
class ToolPlan:
    parse: bool  # parse calls out of the output
    constraint: pb.Constraint | None


def _tools(req: ChatRequest) -> list[dict[str, Any]]:
    tools = req.tools
    if tools in (None, []):
        return []
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}", f"tools[{i}]")
        params = f.get("parameters", {})
        names = params.get("required", []) if isinstance(params, dict) else None
        if (
            not isinstance(params, dict)
            or not isinstance(params.get("properties", {}), dict)
            or not isinstance(names, list)
            or not all(isinstance(r, str) for r in names)
        ):
            raise bad(
                f"tools[{i}].function.parameters must be a JSON schema object (properties an object, "
                "required a list of names)",
                f"tools[{i}].function.parameters",
            )
    return tools


def plan(
    req: ChatRequest, fmt: ToolFormat | None, think_close: int | None, customs: dict[str, CustomTool] | None = None
) -> ToolPlan:
    """What to do for `req`; `fmt` is the checkpoint's call format (None: no parser), `think_close`
    the `</think>` id when the prompt leaves a think block open, `customs` the custom tools among
    `req.tools` (router/custom_tools.py: seen as functions of one `input`)."""
    tools, choice = _tools(req), req.tool_choice
    named = None
    allowed = None  # names the calls may use (`allowed_tools`); None: every tool
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        choice, allowed = _allowed(choice, tools)
    if isinstance(choice, dict):
        f = choice.get("function") if choice.get("type") == "function" else None
        named = f.get("name") if isinstance(f, dict) else None
        if not isinstance(named, str):
            raise bad("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', ...}", "tool_choice")
        choice = "named"
    elif choice not in (None, "none", "auto", "required"):
        raise bad(
            f"'tool_choice' must be 'none', 'auto', 'required' or a named function (got {choice!r})", "tool_choice"
        )
    if choice in ("required", "named") and not tools:
        raise bad(f"'tool_choice' {choice} needs 'tools'", "tool_choice")
    constraint = structured_fields.constraint(req)
    if not tools or choice == "none":
        return ToolPlan(False, _start(constraint, think_close))
    if fmt is None:
        if choice in ("required", "named"):
            raise bad(
                "this model's chat template writes no tool-call format the router knows "
                "(start the router with --tool-call-parser)",
                "tool_choice",
            )
        return ToolPlan(False, _start(constraint, think_close))
    if fmt == "xml":
        _xml_names(req, tools)
    if allowed is not None:
        tools = [t for t in tools if t["function"]["name"] in allowed]
    if choice in ("required", "named"):
        if constraint is not None:
            raise bad(
                "a required tool call and a response format (or another output constraint) exclude each other",
                "tool_choice",
            )
        fns = [t["function"] for t in tools]
        if named is not None:
            fns = [f for f in fns if f["name"] == named]
            if not fns:
                raise bad(f"'tool_choice' names {named!r}, which is not in 'tools'", "tool_choice")
        many = named is None and req.parallel_tool_calls is not False
        _compiles(req, fns, customs)
        constraint = pb.Constraint(grammar=call_grammar(fmt, fns, many, customs))
    elif constraint is None and (allowed is not None or _strict(tools, customs)):  # auto: text, then calls
        many = req.parallel_tool_calls is not False
        fns = [t["function"] for t in tools]
        _compiles(req, fns, customs)
        constraint = pb.Constraint(grammar=call_grammar(fmt, fns, many, customs, text_first=True))
    return ToolPlan(True, _start(constraint, think_close))


def _xml_names(req: ChatRequest, tools: list[dict[str, Any]]) -> None:
    """The XML call format writes names between `<function=` / `<parameter=` and `>`, one line:
    a tool or parameter name with `>`, a line break or blanks at its ends would be read back as
    another name (and the call's text as content): a 400 naming it."""
    for i, t in enumerate(tools):
        params = t["function"].get("parameters") or {}
        where = req.schema_field(i)
        named = [(t["function"]["name"], where.rsplit(".", 1)[0] + ".name")]
        named += [(k, f"{where}.properties") for k in params.get("properties", {})]
        for name, field in named:
            if ">" in name or "\n" in name or "\r" in name or name != name.strip() or not name:
                raise bad(
                    f"{field}: {name!r} cannot be written in this model's tool-call format "
                    "(no '>', line break or surrounding blanks in a tool or parameter name)",
                    field,
                )


def _compiles(req: ChatRequest, fns: list[dict[str, Any]], customs: dict[str, CustomTool] | None) -> None:
    """Each function schema the call grammar follows compiles alone: a 400 naming the tool's
    parameters (not the nodes' refusal of the whole grammar)."""
    at = {t["function"]["name"]: i for i, t in enumerate(req.tools or [])}
    for f in fns:
        if f["name"] not in (customs or {}):
            structured_fields.check_schema(req.schema_field(at[f["name"]]), f.get("parameters") or {})


def _allowed(choice: dict[str, Any], tools: list[dict[str, Any]]) -> tuple[str, set[str]]:
    """OpenAI's `{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools":
    [{"type": "function", "function": {"name"}} | {"type": "custom", "custom": {"name"}}]}}`: the
    prompt keeps every tool, the calls may use these only."""
    spec = choice.get("allowed_tools")
    mode = spec.get("mode") if isinstance(spec, dict) else None
    listed = spec.get("tools") if isinstance(spec, dict) else None
    if mode not in ("auto", "required") or not isinstance(listed, list) or not listed:
        raise bad(
            "'tool_choice' allowed_tools needs 'mode' ('auto' or 'required') and a non-empty 'tools' list",
            "tool_choice.allowed_tools",
        )
    have = {t["function"]["name"] for t in tools}
    names = set()
    for i, t in enumerate(listed):
        kind = t.get("type") if isinstance(t, dict) else None
        ref = t.get(kind) if kind in ("function", "custom") else None
        name = ref.get("name") if isinstance(ref, dict) else None
        if not isinstance(name, str) or name not in have:
            raise bad(
                f"'tool_choice' allowed_tools.tools[{i}] must name a tool in 'tools' "
                "({'type': 'function', 'function': {'name': ...}})",
                f"tool_choice.allowed_tools.tools[{i}]",
            )
        names.add(name)
    return mode, names


def _strict(tools: list[dict[str, Any]], customs: dict[str, CustomTool] | None) -> bool:
    """A function tool marked `strict: true`, or a custom tool with a grammar: under `auto`, calls
    are constrained too."""
    return any(t["function"].get("strict") is True for t in tools) or any(
        c.syntax is not None for c in (customs or {}).values()
    )


def _start(c: pb.Constraint | None, think_close: int | None) -> pb.Constraint | None:
    if c is not None and think_close is not None:
        c.start_after_token = think_close
    return c


# ---- the call grammars ----------------------------------------------------------------------------
def _json(schema: dict[str, Any], defs: dict[str, Any] | None = None) -> str:
    """JSON inside a call, with the JSON constraints' bounded whitespace (engine/structured/grammar.py);
    `defs`: the tool's `$defs` / `definitions`, which the schema's `$ref`s point into."""
    return "%json " + json.dumps(bounded_json({**(defs or {}), **schema}))


def _defs(params: dict[str, Any]) -> dict[str, Any]:
    """The parameters' `$defs` and `definitions`: embedded with each schema that may refer to them."""
    return {k: params[k] for k in ("$defs", "definitions") if isinstance(params.get(k), dict)}


_TEXT = r"/([^<]|<[^\/]){%s}\n<\/parameter>\n/"  # a string value: no "</" inside, then its close tag
# with a maxLength: no "<" at all, each unit one character (a "<x" unit is two: it ran past the bound)
_SHORT_TEXT = r"/[^<]{%s}\n<\/parameter>\n/"


def call_grammar(
    fmt: ToolFormat,
    fns: list[dict[str, Any]],
    many: bool,
    customs: dict[str, CustomTool] | None = None,
    text_first: bool = False,
) -> str:
    """A Lark grammar of one call (`many`: one or more, a newline apart) of any of `fns`; a custom
    tool's `input` follows its own grammar. `text_first`: free text (no special tokens), then
    optionally the calls (`auto` with strict tools)."""
    calls = "call" + (' ("\\n" call)*' if many else "")
    # the text a call may follow: anything but the call tag spelled out in ordinary tokens (which
    # the parser would read as a call the grammar never constrained)
    text = "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/"
    rules = [f"start: TEXT ({calls})?\n{text}" if text_first else f"start: {calls}"]
    rules.append('call: <tool_call> "\\n" (' + " | ".join(f"fn{i}" for i in range(len(fns))) + ") </tool_call>")
    for i, f in enumerate(fns):
        params = f.get("parameters") or {}
        custom = (customs or {}).get(f["name"])
        rule = custom.rule() if custom is not None else None
        if rule is not None and fmt == "json":  # the input is a JSON string: a regex as its pattern
            if custom is None or custom.syntax != "regex":
                raise bad(
                    "a custom tool's Lark grammar is enforced in the XML call format only (this model writes "
                    "JSON calls); a regex grammar works in both",
                    "tools",
                )
            pattern = {"type": "string", "pattern": f"^(?:{custom.definition})$"}
            params = {
                "type": "object",
                "properties": {INPUT: pattern},
                "required": [INPUT],
                "additionalProperties": False,
            }
        elif rule is not None:
            head = json.dumps(f"<function={f['name']}>\n<parameter={INPUT}>\n")
            rules.append(f'fn{i}: {head} {rule} "\\n</parameter>\\n</function>\\n"')
            continue
        if fmt == "json":
            args = params or {"type": "object"}
            if "properties" in args and "additionalProperties" not in args:
                args = {**args, "additionalProperties": False}  # only the named parameters, as in the XML calls
            obj = {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": args},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            # the arguments' `#/$defs/...` references resolve against the root of the embedded schema
            rules.append(f'fn{i}: {_json(obj, _defs(args))} "\\n"')
            continue
        props, required = params.get("properties", {}), set(params.get("required", ()))
        body = []
        for j, (k, schema) in enumerate(props.items()):
            rules.append(f"fn{i}p{j}: {json.dumps(f'<parameter={k}>' + chr(10))} {_value(schema, params)}")
            body.append(f"fn{i}p{j}" + ("" if k in required else "?"))
        head = json.dumps(f"<function={f['name']}>\n")
        rules.append(f'fn{i}: {head} {" ".join(body)} "</function>\\n"')
    return "\n".join(rules) + "\n"


def _value(schema: Any, params: dict[str, Any]) -> str:
    """One parameter's value as the template writes it (and router/parsers/values.py reads it back):
    a string as it is (an enum: one of its strings), a string-or-null as a string (`null` among
    them), anything else as JSON of its schema, which may refer to the tool's `$defs`."""
    close = '"\\n</parameter>\\n"'
    resolved = resolve(schema, params)
    s = resolved if isinstance(resolved, dict) else {}
    text = s if is_text(resolved) and schema is not None else nullable_text(resolved)
    if text is not None and isinstance(text.get("enum"), list):
        return "(" + " | ".join(json.dumps(str(v)) for v in text["enum"]) + ") " + close
    if text is not None or schema is None:
        t = text or {}
        lo, hi = t.get("minLength"), t.get("maxLength")  # bounds that are not counts are left out
        lo = lo if isinstance(lo, int) and lo >= 0 else 0
        hi = hi if isinstance(hi, int) and hi >= lo else None
        return _TEXT % f"{lo}," if hi is None else _SHORT_TEXT % f"{lo},{hi}"
    return f"{_json(s, _defs(params))} {close}"
