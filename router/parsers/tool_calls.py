"""Tool calls lifted out of generated text, streamed as OpenAI deltas as soon as each piece is
certain. Two formats, chosen from the checkpoint's chat template or `--tool-call-parser`:

- `xml` (Qwen3.5, Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>
  \\n</function>\\n</tool_call>`. The name goes out at `<function=NAME>`; `arguments` is built as
  the JSON object of the parameters in order: a string-typed value streams as it comes, others
  (converted by the tool's schema types, router/parsers/values.py) when their `</parameter>` closes.
- `json` (Qwen2.5, Qwen3): `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`. The name
  goes out once it is read; the arguments when the call closes.

A custom tool's call (router/custom_tools.py) gives its `input` parameter's text instead, streamed
as it comes (`ToolDelta.arguments` then carries the input, `custom` marks the call's start).

Text outside calls passes through in order (`str` items). A call cut off (the output ended inside
it) keeps what was sent: its name and the arguments so far; cut off before its name, the raw text
passes through instead when it was the first call, and is dropped after calls (markup, not
content: the answer is the calls that came). A block that does not parse as a call passes
through as text, whole.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from router.custom_tools import INPUT
from router.parsers.held import first, safe_end
from router.parsers.values import convert, dumps_exact, is_text, loads_exact, param_schemas

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
ToolFormat = Literal["xml", "json"]


@dataclass
class ToolDelta:
    """One piece of call `index`: its start (id and name set) or more of its arguments."""

    index: int
    arguments: str = ""  # a custom tool's call: its input's text
    id: str | None = None
    name: str | None = None
    custom: bool = False


Item = str | ToolDelta


def detect_format(template: str | None) -> ToolFormat | None:
    """The call format a chat template writes, from its text."""
    if not template or CALL_OPEN not in template:
        return None
    return "xml" if "<function=" in template else "json"


class ToolCallParser:
    """Calls in one choice's text (module docstring); `tools` gives the parameters' schemas."""

    def __init__(self, fmt: ToolFormat, tools: list[dict[str, Any]] | None, customs: Collection[str] = ()):
        self.fmt, self.schemas, self.customs = fmt, param_schemas(tools), frozenset(customs)
        self.custom = False  # the current call is a custom tool's: only its input's text goes out
        self.skip = False  # inside a custom call's parameter other than its input: nothing goes out
        self.buf = ""
        self.calls = 0  # calls started
        self.inside = False  # between <tool_call> and </tool_call>
        self.raw = ""  # the current call's text so far, passed through if it never gets a name
        self.named = False
        self.cut = False  # the output ended inside a named call (its arguments are incomplete)
        # xml: "fn" (before <function=), "params" (between parameters), "value" (inside one), "end"
        self.step, self.params = "fn", 0
        self.name, self.key, self.text = "", "", False  # the call's name; the parameter being read; a string?

    def push(self, text: str) -> list[Item]:
        self.buf += text
        out: list[Item] = []
        while self._advance(out):
            pass
        return out

    def flush(self) -> list[Item]:
        """The output ended: a call cut off keeps what was sent (module docstring) and sets `cut`."""
        out: list[Item] = []
        self.cut = self.inside and self.named
        if not self.inside:
            out.append(self.buf)
        elif not self.named and not self.calls:
            out.append(CALL_OPEN + self.raw + self.buf)
        self.buf = ""
        return [x for x in out if x]

    # ---- one step: False when it must wait for more text ---------------------------------------
    def _advance(self, out: list[Item]) -> bool:
        if not self.inside:
            i = self.buf.find(CALL_OPEN)
            end = i if i >= 0 else safe_end(self.buf, (CALL_OPEN,))
            if end:
                out.append(self.buf[:end])
            if i < 0:
                self.buf = self.buf[end:]
                return False
            self.buf = self.buf[i + len(CALL_OPEN) :]
            self.inside, self.raw, self.named, self.step, self.params = True, "", False, "fn", 0
            return True
        return self._xml(out) if self.fmt == "xml" else self._json(out)

    def _take(self, n: int) -> str:
        s, self.buf = self.buf[:n], self.buf[n:]
        self.raw += s
        return s

    def _start(self, out: list[Item], name: str) -> None:
        self.named, self.custom = True, name in self.customs
        out.append(ToolDelta(self.calls, "", "call_" + uuid.uuid4().hex[:24], name, self.custom))
        self.name = name

    def _end_call(self, out: list[Item]) -> bool:
        """At `</tool_call>`: the next call has the next index; a block never named passes through."""
        if not self.named:
            out.append(CALL_OPEN + self.raw + CALL_CLOSE)
        else:
            self.calls += 1
        self.inside = False
        return True

    def _xml(self, out: list[Item]) -> bool:
        b = self.buf
        if self.step == "value":
            i, tag = first(b, ("</parameter>",))
            if i < 0:
                end = safe_end(b, ("\n</parameter>",))
                if self.text and end and b[:end].rstrip("\n"):
                    keep = b[:end].rstrip("\n")  # a newline may be the one before </parameter>
                    self._value_piece(out, self._take(len(keep)))
                return False
            value = self._take(i)
            self._take(len(tag))
            if value.endswith("\n"):
                value = value[:-1]
            self._value_end(out, value)
            self.step = "params"
            return True
        stripped = b.lstrip()
        if not stripped:
            return False
        skip = len(b) - len(stripped)
        if self.step == "fn":
            m = re.match(r"<function=([^>\n]*)>", stripped)
            if m:
                self._take(skip + m.end())
                self._start(out, m.group(1).strip())
                self.step = "params"
                return True
            return self._give_up_or_wait(out, stripped, "<function=")
        if self.step == "params":
            m = re.match(r"<parameter=([^>\n]*)>\n?", stripped)
            if m and (m.end() < len(stripped) or m.group(0).endswith("\n")):
                self._take(skip + m.end())
                self._value_start(out, m.group(1).strip())
                self.step = "value"
                return True
            if stripped.startswith("</function>"):
                self._take(skip + len("</function>"))
                self._close_args(out)
                self.step = "end"
                return True
            return self._give_up_or_wait(out, stripped, "<parameter=", "</function>")
        if stripped.startswith(CALL_CLOSE):  # step "end"
            self._take(skip + len(CALL_CLOSE))
            return self._end_call(out)
        return self._give_up_or_wait(out, stripped, CALL_CLOSE)

    def _give_up_or_wait(self, out: list[Item], s: str, *tags: str) -> bool:
        """Wait while `s` may still begin one of `tags` (`<parameter=KEY` before its `>` too);
        else the call is malformed: what is left of it passes through as text up to `</tool_call>`."""
        if any(t.startswith(s) or (s.startswith(t) and "\n" not in s) for t in tags):
            return False
        i = self.buf.find(CALL_CLOSE)
        if i < 0:
            return False
        if self.named:  # its name and arguments so far were sent: close them; the rest is text
            if self.step != "end":
                self._close_args(out)
            out.append(self.buf[:i])
            self.buf = self.buf[i + len(CALL_CLOSE) :]
        else:
            self._take(i)
            self.buf = self.buf[len(CALL_CLOSE) :]
        return self._end_call(out)

    def _close_args(self, out: list[Item]) -> None:
        if not self.custom:
            out.append(ToolDelta(self.calls, "}" if self.params else "{}"))

    def _value_start(self, out: list[Item], key: str) -> None:
        if self.custom:  # only the input's text goes out, as it is
            self.key, self.text, self.skip = key, True, key != INPUT
            return
        schema = self.schemas.get(self.name, {}).get(key)
        self.key, self.text = key, is_text(schema)
        head = ("{" if not self.params else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        self.params += 1
        out.append(ToolDelta(self.calls, head + ('"' if self.text else "")))

    def _value_piece(self, out: list[Item], s: str) -> None:
        if s and not (self.custom and self.skip):
            out.append(ToolDelta(self.calls, s if self.custom else json.dumps(s, ensure_ascii=False)[1:-1]))

    def _value_end(self, out: list[Item], rest: str) -> None:
        if self.custom:
            self._value_piece(out, rest)
            return
        if self.text:
            self._value_piece(out, rest)
            out.append(ToolDelta(self.calls, '"'))
            return
        schema = self.schemas.get(self.name, {}).get(self.key)
        out.append(ToolDelta(self.calls, dumps_exact(convert(rest, schema))))

    def _json(self, out: list[Item]) -> bool:
        if not self.named:
            m = re.match(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")', self.buf)
            if m:
                self._start(out, json.loads(m.group(1)))
        i = self.buf.find(CALL_CLOSE)
        if i < 0:
            return False
        body = self._take(i)
        self.buf = self.buf[len(CALL_CLOSE) :]
        try:
            call = loads_exact(body)
            args = call.get("arguments", call.get("parameters", {}))
        except (ValueError, AttributeError):
            call, args = None, None
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            if not self.named:
                self._start(out, call["name"])
            if self.custom and isinstance(args, dict) and isinstance(args.get(INPUT), str):
                args = args[INPUT]
            out.append(ToolDelta(self.calls, args if isinstance(args, str) else dumps_exact(args)))
        elif self.named:  # named, but the block is not a call object: its text passes through
            out.append(body)
        return self._end_call(out)
