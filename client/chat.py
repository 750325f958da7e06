"""Chat through the router (`Generation.Chat`, router/grpc_chat.py): an OpenAI chat completions
body in (`messages`, `tools`, `tool_choice`, `response_format`, sampling fields, ...), rendered with
the checkpoint's chat template on the router; out, OpenAI's chunks as dicts (`index`, `delta` with
`content`, `reasoning_content`, `tool_calls`, `finish_reason`), then `{"usage": ...}`, folded by
`ChatResult` into one message per choice as OpenAI's whole answer has it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from proto import pb


def chat_request(messages: list[dict[str, Any]], model: str, fields: dict[str, Any]) -> pb.ChatRequest:
    return pb.ChatRequest(body_json=json.dumps({**fields, "model": model, "messages": messages}))


def chunk_of(m: pb.ChatChunk) -> dict[str, Any]:
    """A choice's chunk, or `{"usage": ...}` (the last message)."""
    return json.loads(m.choice_json) if m.choice_json else {"usage": json.loads(m.usage_json or "{}")}


@dataclass
class ChatChoice:
    index: int
    message: dict[str, Any] = field(default_factory=lambda: {"role": "assistant", "content": None})
    finish_reason: str | None = None


@dataclass
class ChatResult:
    """The whole answer: `choices` (each `message` as OpenAI's: `content`, `reasoning_content`,
    `tool_calls`), `usage`; `message` is the first choice's."""

    choices: list[ChatChoice] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def message(self) -> dict[str, Any]:
        return self.choices[0].message

    def add(self, chunk: dict[str, Any]) -> None:
        if "usage" in chunk and "delta" not in chunk:
            self.usage = chunk["usage"]
            return
        i = chunk["index"]
        while len(self.choices) <= i:
            self.choices.append(ChatChoice(len(self.choices)))
        c = self.choices[i]
        c.finish_reason = chunk.get("finish_reason") or c.finish_reason
        d, msg = chunk.get("delta") or {}, c.message
        for k in ("content", "reasoning_content"):
            if d.get(k):
                msg[k] = (msg.get(k) or "") + d[k]
        for tc in d.get("tool_calls") or ():
            calls = msg.setdefault("tool_calls", [])
            kind = tc.get("type") or calls[tc["index"]]["type"]
            part, text = tc.get(kind) or {}, "input" if kind == "custom" else "arguments"
            if "id" in tc:
                calls.append({"id": tc["id"], "type": kind, kind: {"name": part.get("name", ""), text: ""}})
            calls[tc["index"]][kind][text] += part.get(text, "")
