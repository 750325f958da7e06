"""Chat through the gRPC SDK (`Client.chat`, `chat_stream`, `AsyncClient.chat`; router/grpc_chat.py)
against `pdserve up` (1 prefill + 1 decode node, the tiny checkpoint with Qwen3.5's template): the
prompt is transformers' rendering of the messages (usage), the greedy content is transformers'
greedy continuation of it, a required tool call's arguments validate against the schema
(jsonschema), the streamed chunks fold to the whole answer, and bad bodies end the call with
INVALID_ARGUMENT / NOT_FOUND naming the fault."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.agent_tools import WEATHER

MESSAGES = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}]
TOOL = WEATHER
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def client(http_up):
    from client import Client

    with Client(http_up.address, timeout=120) as c:
        c.wait_ready(timeout=60)
        yield c


def test_chat_is_the_template_and_greedy_tokens(client, hf, ckpt):
    ids = hf.encode(
        hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, enable_thinking=False),
        add_special_tokens=False,
    )
    want = hf.decode(hc.hf_greedy(ckpt, ids, 10), skip_special_tokens=True)
    r = client.chat(MESSAGES, temperature=0.0, max_tokens=10, ignore_eos=True, **NO_THINK)
    assert r.usage["prompt_tokens"] == len(ids) and r.usage["completion_tokens"] == 10
    assert r.message["content"] == want and r.choices[0].finish_reason == "length"
    streamed = list(client.chat_stream(MESSAGES, temperature=0.0, max_tokens=10, ignore_eos=True, **NO_THINK))
    last = streamed[-1]["usage"]  # the second time, the prompt's cached pages count as cached tokens
    assert (last["prompt_tokens"], last["completion_tokens"]) == (len(ids), 10)
    assert "".join(c["delta"].get("content") or "" for c in streamed[:-1]) == want


def test_required_tool_call_follows_the_schema(client, http_up):
    import jsonschema

    from client import AsyncClient

    kw = dict(tools=[TOOL], tool_choice="required", temperature=0.0, max_tokens=200, **NO_THINK)
    r = client.chat(MESSAGES, **kw)
    (call,) = r.message["tool_calls"][:1]
    assert r.choices[0].finish_reason == "tool_calls" and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL["function"]["parameters"])

    async def via_aio():
        async with AsyncClient(http_up.address, timeout=120) as c:
            return await c.chat(MESSAGES, **kw)

    a = asyncio.run(via_aio())
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in a.message["tool_calls"]] == [
        (t["function"]["name"], t["function"]["arguments"]) for t in r.message["tool_calls"]
    ]


@pytest.mark.parametrize(
    "fields, code, words",
    [
        ({"temperature": -1}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        ({"tool_choice": "required"}, grpc.StatusCode.INVALID_ARGUMENT, "needs 'tools'"),
        ({"model": "nope"}, grpc.StatusCode.NOT_FOUND, "model 'nope' not found"),
    ],
)
def test_bad_bodies_end_the_call_naming_the_fault(client, fields, code, words):
    from client import PdserveError

    with pytest.raises(PdserveError) as e:
        client.chat(MESSAGES, **fields)
    assert e.value.code == code and words in e.value.message, e.value
