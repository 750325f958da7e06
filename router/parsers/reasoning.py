"""Reasoning split: the text between `<think>` and `</think>` is reasoning, the rest content.

The parser starts inside the reasoning when the rendered prompt left a think block open
(router/chat_template.py `think_open`), else in the content, where an opening tag the model writes
itself starts reasoning. Output cut off inside the reasoning is all reasoning. The newlines the
layout puts around a think block (after `<think>`, before `</think>`, after `</think>`) are not
part of either text: a template re-renders them."""

from __future__ import annotations

from typing import Literal

from router.parsers.held import safe_end

Kind = Literal["reasoning", "content"]


class ReasoningParser:
    def __init__(self, in_reasoning: bool, open_tag: str = "<think>", close_tag: str = "</think>"):
        self.kind: Kind = "reasoning" if in_reasoning else "content"
        self.tags = {"reasoning": close_tag, "content": open_tag}
        self.buf = ""
        self.lead = in_reasoning  # dropping the newlines that open the current part
        self.nl = ""  # newlines at the end of the reasoning so far: kept unless `</think>` follows

    def push(self, text: str) -> list[tuple[Kind, str]]:
        """Add text; returns the (kind, text) pieces certain now, in order."""
        self.buf += text
        out: list[tuple[Kind, str]] = []
        while True:
            tag = self.tags[self.kind]
            i = self.buf.find(tag)
            if i < 0:
                end = safe_end(self.buf, (tag,))
                self._emit(out, self.buf[:end])
                self.buf = self.buf[end:]
                return out
            self._emit(out, self.buf[:i])
            self.buf = self.buf[i + len(tag) :]
            self.nl = ""
            self.kind = "content" if self.kind == "reasoning" else "reasoning"
            self.lead = True

    def flush(self) -> list[tuple[Kind, str]]:
        """The output ended: release what was held."""
        out: list[tuple[Kind, str]] = []
        self._emit(out, self.buf)
        self.buf = ""
        if self.nl:
            out.append(("reasoning", self.nl))
            self.nl = ""
        return out

    def _emit(self, out: list[tuple[Kind, str]], s: str) -> None:
        if self.lead:
            s = s.lstrip("\n")
            self.lead = not s
        if self.kind == "reasoning":
            s = self.nl + s
            body = s.rstrip("\n")
            self.nl, s = s[len(body) :], body
        if s:
            out.append((self.kind, s))
