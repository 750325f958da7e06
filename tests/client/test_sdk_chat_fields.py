"""`Client.chat` / `chat_stream` (and AsyncClient's) take the chat body's fields as keywords: a name
that is not a chat request field (a misspelling the router would log and ignore) is a TypeError
naming it, before any call; `extra_body={...}` sends any field as it is (OpenAI's SDK's way)."""

from __future__ import annotations

import asyncio
import json

import pytest

from client import AsyncClient, Client
from client.chat import CHAT_FIELDS, chat_request, check_fields

NOWHERE = "127.0.0.1:1"
MSGS = [{"role": "user", "content": "hi"}]


def test_the_sdks_chat_fields_are_the_routers():
    from router.openai_models import ChatRequest

    assert set(ChatRequest.model_fields) - {"model", "messages"} == CHAT_FIELDS


def test_unknown_fields_are_refused_naming_them():
    with Client(NOWHERE, timeout=5) as c:
        with pytest.raises(TypeError, match="unknown field.*foo_bar, temprature.*extra_body"):
            c.chat(MSGS, model="m", foo_bar=1, temprature=0.5, temperature=0.0)
        with pytest.raises(TypeError, match="foo_bar"):
            next(iter(c.chat_stream(MSGS, model="m", foo_bar=1)))
        with pytest.raises(TypeError, match="extra_body must be a dict"):
            c.chat(MSGS, model="m", extra_body=[("user", "u")])

    async def aio() -> None:
        async with AsyncClient(NOWHERE, timeout=5) as c:
            with pytest.raises(TypeError, match="foo_bar"):
                await c.chat(MSGS, model="m", foo_bar=1)

    asyncio.run(aio())


def test_documented_fields_and_extra_body_go_in_the_body():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    fields = dict(tools=tools, tool_choice="required", chat_template_kwargs={"enable_thinking": False}, temperature=0.0)
    check_fields(fields, {"user": "u"})
    body = json.loads(chat_request(MSGS, "m", fields, {"user": "u", "temperature": 0.5}).body_json)
    assert body == {**fields, "temperature": 0.5, "user": "u", "model": "m", "messages": MSGS}
