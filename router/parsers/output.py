"""One chat choice's output through the parsers: text deltas in, OpenAI stream-delta fields
(`content`, `reasoning_content`, `tool_calls`) out, and the whole message as the fold of them, so
a streamed answer assembles to exactly the unstreamed one.

Tool calls are lifted out first, wherever they are: a call the model writes inside its reasoning
is delivered as a call like any other (and is not part of `reasoning_content`). The rest is split
into reasoning and content. Only `reasoning_content` is filled (not also `reasoning`): it is the
name the reasoning models' own APIs and the agent frameworks read, and a second copy would double
the bytes of the longest part of an agent's stream."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from router.parsers.reasoning import Kind, ReasoningParser
from router.parsers.tool_calls import Item, ToolCallParser, ToolDelta, ToolFormat

_TEXT = {"function": "arguments", "custom": "input"}  # what a call's pieces add to, by its type


class ChatOutput:
    def __init__(
        self,
        tool_format: ToolFormat | None,
        tools: list[dict[str, Any]] | None,
        reasoning: bool,
        think_open: bool,
        customs: Collection[str] = (),
    ):
        self.tools = ToolCallParser(tool_format, tools, customs) if tool_format is not None else None
        self.reasoning = ReasoningParser(think_open) if reasoning else None
        self.content: list[str] = []
        self.thought: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.reasoning_tokens = 0
        self.blank = ""  # content's trailing whitespace, held: dropped at the end if calls came, else content

    def push(self, text: str, final: bool = False, tokens: int = 0) -> dict[str, Any]:
        """The delta fields `text` adds (`final`: the output ended; release what is held);
        `tokens`: how many tokens made it, counted as reasoning tokens when the reasoning was
        open before it (so the closing `</think>` counts; usage's `reasoning_tokens`)."""
        if self.reasoning is not None and self.reasoning.kind == "reasoning":
            self.reasoning_tokens += tokens
        items: list[Item] = self.tools.push(text) if self.tools is not None else [text]
        if final and self.tools is not None:
            items += self.tools.flush()
        delta: dict[str, Any] = {}
        for it in items:
            if isinstance(it, ToolDelta):
                self._call(delta, it)
            elif self.reasoning is not None:
                self._text(delta, self.reasoning.push(it))
            else:
                self._text(delta, [("content", it)])
        if final and self.reasoning is not None:
            self._text(delta, self.reasoning.flush())
        if final and self.blank:
            blank, self.blank = self.blank, ""
            if not self.calls:
                self._text(delta, [("content", blank)], release=True)
        return delta

    def _text(self, delta: dict[str, Any], pieces: list[tuple[Kind, str]], release: bool = False) -> None:
        for kind, s in pieces:
            if kind == "content" and not release:  # trailing whitespace waits: before a call it is no content
                s = self.blank + s
                body = s.rstrip()
                self.blank, s = s[len(body) :], body
                if not s:
                    continue
            name = "content" if kind == "content" else "reasoning_content"
            (self.content if kind == "content" else self.thought).append(s)
            delta[name] = delta.get(name, "") + s

    def _call(self, delta: dict[str, Any], d: ToolDelta) -> None:
        """A call's piece: a function's `arguments`, or a custom tool's `input` (OpenAI's custom
        tool call, `{"type": "custom", "custom": {"name", "input"}}`, streamed the same way)."""
        entries = delta.setdefault("tool_calls", [])
        if d.name is not None:
            kind = "custom" if d.custom else "function"
            self.calls.append({"id": d.id, "type": kind, kind: {"name": d.name, _TEXT[kind]: ""}})
            entries.append({"index": d.index, "id": d.id, "type": kind, kind: {"name": d.name}})
        call = self.calls[d.index]
        kind = call["type"]
        field = _TEXT[kind]
        call[kind][field] += d.arguments
        if not entries or entries[-1]["index"] != d.index:
            entries.append({"index": d.index, kind: {}})
        part = entries[-1][kind]
        if d.arguments or field not in part:
            part[field] = part.get(field, "") + d.arguments

    @property
    def calls_done(self) -> bool:
        """Calls came and the output did not end inside one (a stop string or EOS cut it short)."""
        return bool(self.calls) and not (self.tools is not None and self.tools.cut)

    def message(self) -> dict[str, Any]:
        """The whole message: the fold of every delta."""
        content = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant", "content": content or (None if self.calls else "")}
        if self.reasoning is not None:
            msg["reasoning_content"] = "".join(self.thought) or None
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg
