"""Stored responses (docs/api.md, "Stored responses"): what `POST /v1/responses` with `store`
(OpenAI's default) keeps, so that a later request continues it by `previous_response_id` and
`GET` / `DELETE /v1/responses/{id}` and its `input_items` find it. Kept in the memory of the
router that answered, within --responses-store-mb, the least recently used dropped first. A
stored response holds the conversation's input items (the earlier turns' item objects shared,
not copied, then its own input) and its output, so a chain costs each turn's own items once and
survives the eviction of the responses before it."""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from router.openai_models import ApiError

_ID_PREFIX = {"message": "msg", "function_call": "fc", "custom_tool_call": "ctc", "reasoning": "rs"}


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any]  # as it was answered
    items: list[dict[str, Any]]  # its whole input: the earlier turns', then its own
    size: int  # bytes counted against the store: its response and its own input items, as JSON


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` as input items with ids (a string is one user message), as
    `input_items` lists them; the caller's dicts are copied, not changed."""
    raw = [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value
    out = []
    for it in raw:
        item = dict(it)
        kind = item.setdefault("type", "message")
        if "id" not in item:
            item["id"] = f"{_ID_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex[:24]}"
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        out.append(item)
    return out


def not_found(rid: str) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{rid}' not found on this router (responses are kept in the memory of the router "
        "that made them, while it runs).",
        param="response_id",
    )


class ResponseStore:
    """Responses by id, least recently used first; `max_bytes` 0 stores nothing."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._by_id: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def gauges(self) -> dict[str, tuple[str, float]]:
        """The router's /metrics gauges of the store."""
        return {
            "responses_stored": ("Responses kept for previous_response_id and GET /v1/responses/{id}", len(self)),
            "responses_stored_bytes": ("Bytes the stored responses count against --responses-store-mb", self.bytes),
        }

    def put(self, response: dict[str, Any], prior: list[dict[str, Any]], own: list[dict[str, Any]]) -> bool:
        """Keep `response` (input: `prior` + `own`); False when it alone is over the limit."""
        size = len(json.dumps(response, separators=(",", ":"))) + len(json.dumps(own, separators=(",", ":")))
        if size > self.max_bytes:
            return False
        self.delete(response["id"])
        self._by_id[response["id"]] = Stored(response, prior + own, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._by_id.popitem(last=False)
            self.bytes -= old.size
        return True

    def get(self, rid: str) -> Stored | None:
        s = self._by_id.get(rid)
        if s is not None:
            self._by_id.move_to_end(rid)
        return s

    def delete(self, rid: str) -> bool:
        s = self._by_id.pop(rid, None)
        if s is not None:
            self.bytes -= s.size
        return s is not None

    def conversation(self, rid: Any) -> list[dict[str, Any]]:
        """The input items a request continuing response `rid` starts from: its input, then its
        output; a 400 naming previous_response_id when it is not here."""
        if not isinstance(rid, str) or not rid:
            raise ApiError(400, "previous_response_id must be a response id (a string)", param="previous_response_id")
        if not self.enabled:
            raise ApiError(
                400,
                "previous_response_id: this router stores no responses (--responses-store-mb 0); "
                "send the whole conversation as input",
                param="previous_response_id",
            )
        s = self.get(rid)
        if s is None:
            raise ApiError(
                400,
                f"Previous response with id '{rid}' not found: it was not stored (store: false), was deleted, "
                "was dropped to keep this router's store within --responses-store-mb, this router restarted since, "
                "or another router answered it (responses are kept in the memory of the router that made them); "
                "send the whole conversation as input",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return s.items + list(s.response["output"])

    def page(self, rid: str, limit: int, order: str, after: str | None) -> dict[str, Any]:
        """OpenAI's list of a stored response's input items (`order` desc: newest first)."""
        s = self.get(rid)
        if s is None:
            raise not_found(rid)
        items = s.items if order == "asc" else s.items[::-1]
        if after is not None:
            at = next((i for i, it in enumerate(items) if it.get("id") == after), None)
            if at is None:
                raise ApiError(400, f"after: no input item '{after}' in response '{rid}'", param="after")
            items = items[at + 1 :]
        data = items[:limit]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(items) > limit,
        }
