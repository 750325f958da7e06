"""`POST /v1/messages` answers: a choice's chat deltas (router/parsers/output.py) as Anthropic
content blocks (`thinking`, `text`, `tool_use`) and the stream events that build them
(`content_block_start`, `content_block_delta` with `thinking_delta` / `text_delta` /
`input_json_delta`, `content_block_stop`). A block opens when its first piece arrives and closes
when a piece of another block (or the end) comes, so the stream and the whole message hold the
same blocks in the same order; the whole message is built by the same code."""

from __future__ import annotations

from typing import Any

from router.parsers.values import dumps_exact, loads_exact


def stop_reason(finish: str | None, stop: str) -> str:
    """Anthropic's stop_reason of a chat finish_reason (`stop`: the stop sequence matched, if any)."""
    if finish == "length":
        return "max_tokens"
    if finish == "tool_calls":
        return "tool_use"
    return "stop_sequence" if stop else "end_turn"


def usage(prompt: int, cached: int, output: int) -> dict[str, int]:
    """Anthropic counts the prompt tokens read from the cache apart from `input_tokens`."""
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


class Blocks:
    """The blocks so far; the open one, if any, is the last."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.open = False
        self.calls: dict[int, int] = {}  # tool-call index -> its block's index
        self.args: dict[int, str] = {}  # a tool_use block's index -> its arguments' JSON so far

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta: thinking first, then text, then tool calls."""
        ev: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            self._text(ev, "thinking", delta["reasoning_content"])
        if delta.get("content"):
            self._text(ev, "text", delta["content"])
        for tc in delta.get("tool_calls", ()):
            self._call(ev, tc)
        return ev

    def close(self) -> list[dict[str, Any]]:
        """Close the open block (the output ended, or another block begins)."""
        if not self.open:
            return []
        self.open, at = False, len(self.blocks) - 1
        if at in self.args:
            self.blocks[at]["input"] = _input(self.args[at])
        return [{"type": "content_block_stop", "index": at}]

    def _begin(self, ev: list[dict[str, Any]], block: dict[str, Any]) -> None:
        ev += self.close()
        self.blocks.append(block)
        self.open = True
        ev.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)})

    def _text(self, ev: list[dict[str, Any]], kind: str, s: str) -> None:
        if not self.open or self.blocks[-1]["type"] != kind:
            self._begin(
                ev,
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""},
            )
        self.blocks[-1][kind] += s
        d = {"type": "thinking_delta", "thinking": s} if kind == "thinking" else {"type": "text_delta", "text": s}
        ev.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": d})

    def _call(self, ev: list[dict[str, Any]], tc: dict[str, Any]) -> None:
        fn = tc.get("function", {})
        if "id" in tc:  # a new call
            call_id = "toolu_" + tc["id"].removeprefix("call_")
            self._begin(ev, {"type": "tool_use", "id": call_id, "name": fn.get("name", ""), "input": {}})
            self.calls[tc["index"]] = at = len(self.blocks) - 1
            self.args[at] = ""
        piece = fn.get("arguments") or ""
        if piece:
            at = self.calls[tc["index"]]
            self.args[at] += piece
            ev.append(
                {
                    "type": "content_block_delta",
                    "index": at,
                    "delta": {"type": "input_json_delta", "partial_json": piece},
                }
            )


def _input(args: str) -> dict[str, Any]:
    """A call's input: its arguments' JSON object ({} when cut off before it closed), numbers kept
    as written (`1e999` stays that in the answer, where a float would be Infinity, no JSON)."""
    try:
        v = loads_exact(args) if args else {}
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def body(msg: dict[str, Any]) -> str:
    """A whole message's JSON text: tool inputs' numbers as the model wrote them."""
    return dumps_exact(msg)


def message(mid: str, model: str, blocks: list[dict[str, Any]], reason: str | None, stop: str, use: dict) -> dict:
    """The message object (`reason`: None while it streams)."""
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": stop or None,
        "usage": use,
    }
