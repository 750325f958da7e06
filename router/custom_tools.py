"""OpenAI's custom tools: a tool whose input is free text, or text of a Lark or regex grammar,
instead of JSON arguments (chat: `{"type": "custom", "custom": {"name", "description", "format"}}`;
Responses: the same fields flat, router/responses_request.py). The template sees one as a function
of one string parameter `input` whose description states the grammar, so the checkpoint's own
call format carries it; the parser gives that parameter's text back as the call's `input`
(router/parsers/tool_calls.py), and a required or named call's input follows the grammar, nested
in the call grammar (router/tool_choice.py). History: an assistant's custom call is rendered as
that function's call with `{"input": ...}` as its arguments."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.structured.grammar import check
from proto import pb
from router.openai_models import ChatRequest, bad
from router.structured_fields import as_lark

INPUT = "input"  # the one parameter the template sees
SYNTAXES = ("lark", "regex")


@dataclass(frozen=True)
class CustomTool:
    name: str
    syntax: str | None = None  # "lark", "regex"; None: free text
    definition: str = ""

    def rule(self) -> str | None:
        """The Lark expression of its input in a call grammar (None: free text)."""
        if self.syntax is None:
            return None
        c = pb.Constraint(regex=self.definition) if self.syntax == "regex" else pb.Constraint(grammar=self.definition)
        return as_lark(c)


def _custom(t: dict[str, Any], where: str, flat: bool = False) -> tuple[dict[str, Any], CustomTool]:
    """(the function the template sees, the tool); `where` names the tool in errors, and `flat`:
    its fields as Responses writes them (`tools[i].format`), not chat's (`tools[i].custom.format`)."""
    c = t.get("custom")
    if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"]:
        raise bad(f"{where} must be {{'type': 'custom', 'custom': {{'name': ..., ...}}}}", where)
    at = where if flat else where + ".custom"
    g_at = f"{at}.format" if flat else f"{at}.format.grammar"  # where syntax and definition are
    fmt = c.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    tool = CustomTool(c["name"])
    note = ""
    if kind == "grammar":
        g = fmt.get("grammar")
        syntax = g.get("syntax") if isinstance(g, dict) else None
        definition = g.get("definition") if isinstance(g, dict) else None
        if syntax not in SYNTAXES or not isinstance(definition, str) or not definition:
            raise bad(
                f"{g_at} must have 'syntax' ('lark' or 'regex') and a 'definition'",
                f"{at}.format",
            )
        try:
            check("grammar" if syntax == "lark" else "regex", definition)
        except ValueError as e:
            raise bad(f"{g_at}: {e}", f"{at}.format") from None
        tool = CustomTool(c["name"], syntax, definition)
        note = f"\n\nThe input is text of this {syntax} grammar:\n{definition}"
    elif kind != "text":
        raise bad(f"{at}.format.type must be 'text' or 'grammar'", f"{at}.format")
    desc = c.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad(f"{at}.description must be a string", f"{at}.description")
    fn = {
        "name": c["name"],
        "description": (desc or "") + note,
        "parameters": {"type": "object", "properties": {INPUT: {"type": "string"}}, "required": [INPUT]},
    }
    return {"type": "function", "function": fn}, tool


def check_flat(chat_form: dict[str, Any], where: str) -> None:
    """ApiError naming the Responses body's fields (`tools[i].format`) if the custom tool, in
    chat's form, is malformed."""
    _custom(chat_form, where, flat=True)


def as_functions(req: ChatRequest) -> tuple[ChatRequest, dict[str, CustomTool]]:
    """`req` with its custom tools (and a tool_choice naming one) as the functions the template
    and the call grammars see, and the custom tools by name."""
    tools = req.tools
    if not isinstance(tools, list) or not any(isinstance(t, dict) and t.get("type") == "custom" for t in tools):
        return req, {}
    out, customs = [], {}
    for i, t in enumerate(tools):
        if isinstance(t, dict) and t.get("type") == "custom":
            t, tool = _custom(t, f"tools[{i}]")
            customs[tool.name] = tool
        out.append(t)
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "custom":
        c = choice.get("custom")
        name = c.get("name") if isinstance(c, dict) else None
        if not isinstance(name, str) or name not in customs:
            raise bad(f"'tool_choice' names custom tool {name!r}, which is not in 'tools'", "tool_choice")
        choice = {"type": "function", "function": {"name": name}}
    return req.model_copy(update={"tools": out, "tool_choice": choice}), customs


def history_call(c: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant's custom call in the history as the function call the template renders."""
    cu = c.get("custom")
    if not isinstance(cu, dict) or not isinstance(cu.get("name"), str) or not isinstance(cu.get("input"), str):
        raise bad(f"{where}: expected {{'type': 'custom', 'custom': {{'name': ..., 'input': ...}}}}", where)
    fn = {"name": cu["name"], "arguments": json.dumps({INPUT: cu["input"]}, ensure_ascii=False)}
    return {k: v for k, v in c.items() if k != "custom"} | {"type": "function", "function": fn}
