"""`POST /v1/responses` answers: a choice's chat deltas (router/parsers/output.py) as Responses
output items (`reasoning` with `reasoning_text` content, `message` with `output_text`,
`function_call`, `custom_tool_call`) and the stream events that build them. An item opens when its first piece
arrives and closes when a piece of another item (or the end) comes, so the streamed events and the
whole response list the same items in the same order; the whole response is built by the same
code without sending the events."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


CARRIED = "pdserve-reasoning-v1:"  # encrypted_content here: the reasoning text, base64 (not encrypted)


def carry(text: str) -> str:
    """A reasoning item's `encrypted_content` (asked for with `include: ["reasoning.encrypted_content"]`):
    its text in an opaque string a stateless client sends back, so the next turn renders it."""
    return CARRIED + base64.b64encode(text.encode()).decode()


def carried(value: Any) -> str | None:
    """The reasoning text `carry` put in `value`, or None (another server's, or none)."""
    if not isinstance(value, str) or not value.startswith(CARRIED):
        return None
    try:
        return base64.b64decode(value[len(CARRIED) :], validate=True).decode()
    except ValueError:
        return None


class ResponseItems:
    def __init__(self, carry_reasoning: bool = False) -> None:
        self.carry_reasoning = carry_reasoning
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta: reasoning first, then content, then tool calls."""
        ev: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            self._text(ev, "reasoning", delta["reasoning_content"])
        if delta.get("content"):
            self._text(ev, "message", delta["content"])
        for tc in delta.get("tool_calls", ()):
            self._call(ev, tc)
        return ev

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """Close the open item (the output ended, or another item begins)."""
        item, self.open = self.open, None
        if item is None:
            return []
        at = self.items.index(item)
        item["status"] = status
        if item["type"] == "reasoning" and self.carry_reasoning:
            item["encrypted_content"] = carry(item["content"][0]["text"])
        base = {"item_id": item["id"], "output_index": at}
        if item["type"] == "function_call":
            done = [self.event("response.function_call_arguments.done", arguments=item["arguments"], **base)]
        elif item["type"] == "custom_tool_call":
            done = [self.event("response.custom_tool_call_input.done", input=item["input"], **base)]
        else:
            part = item["content"][0]
            text_done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            done = [
                self.event(text_done, content_index=0, text=part["text"], **base),
                self.event("response.content_part.done", content_index=0, part=dict(part), **base),
            ]
        return done + [self.event("response.output_item.done", output_index=at, item=dict(item))]

    def _begin(self, ev: list[dict[str, Any]], item: dict[str, Any]) -> None:
        ev += self.close()
        self.items.append(item)
        self.open = item
        shown = dict(item, content=[]) if "content" in item else dict(item)
        ev.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=shown))

    def _text(self, ev: list[dict[str, Any]], kind: str, s: str) -> None:
        item = self.open
        if item is None or item["type"] != kind:
            if kind == "reasoning":
                item = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress"}
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress"}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"] = [part]
            self._begin(ev, item)
            at = len(self.items) - 1
            ev.append(
                self.event(
                    "response.content_part.added", item_id=item["id"], output_index=at, content_index=0, part=dict(part)
                )
            )
        item["content"][0]["text"] += s
        kind_ev = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        at = self.items.index(item)
        ev.append(self.event(kind_ev, item_id=item["id"], output_index=at, content_index=0, delta=s, **extra))

    def _call(self, ev: list[dict[str, Any]], tc: dict[str, Any]) -> None:
        """A function call's arguments, or a custom tool call's input (`custom_tool_call`)."""
        custom = "custom" in tc
        fn = tc.get("custom" if custom else "function", {})
        field = "input" if custom else "arguments"
        if "id" in tc:  # a new call
            item = {
                "type": "custom_tool_call" if custom else "function_call",
                "id": _id("ctc" if custom else "fc"),
                "call_id": tc["id"],
                "name": fn.get("name", ""),
                field: "",
                "status": "in_progress",
            }
            self.calls[tc["index"]] = item
            self._begin(ev, item)
        item = self.calls[tc["index"]]
        if fn.get(field):
            item[field] += fn[field]
            at = self.items.index(item)
            kind = "response.custom_tool_call_input.delta" if custom else "response.function_call_arguments.delta"
            ev.append(self.event(kind, item_id=item["id"], output_index=at, delta=fn[field]))


def response(
    rid: str,
    model: str,
    req: Any,
    items: list[dict[str, Any]],
    status: str,
    finish: str | None,
    usage: dict[str, Any] | None,
    store: bool = False,
) -> dict[str, Any]:
    """The response object (`req`: the ResponsesRequest it answers; `store`: it is kept)."""
    incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
    out = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": items,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning,
        "store": store,
        "temperature": req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "top_p": req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": None,
    }
    if usage is not None:
        p, n = usage["prompt_tokens"], usage["completion_tokens"]
        out["usage"] = {
            "input_tokens": p,
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": n,
            "output_tokens_details": {
                "reasoning_tokens": usage.get("completion_tokens_details", {}).get("reasoning_tokens", 0)
            },
            "total_tokens": p + n,
        }
    return out
