"""A fuzz of the router's HTTP front door (the in-process router and fake decode node of
tests/router/conftest.py `door`): every field of a small valid body of each route (completions, chat,
Anthropic's messages, Responses, custom tools), in turn, set to each value of a table of JSON
values of every type and edge, never gets a 500: a 200, or a 400 / 404 with a message."""

from __future__ import annotations

import json
import random

from tests.helpers.front_door import post
from tests.helpers.serve_harness import wait_for

NUMBERS = (0, -1, 1, 2**31, 2**63, 10**30, -(10**30), 0.5, -0.0, 1e308, float("inf"), float("nan"))
OTHERS: tuple[object, ...] = (
    None,
    True,
    "",
    "x",
    "\x00",
    "é" * 3,
    [],
    [1],
    [[1]],
    ["a"],
    [None],
    {},
    {"1": 1},
    {"a": [1]},
)
FIELDS = """model prompt max_completion_tokens temperature top_p top_k min_p presence_penalty frequency_penalty
    repetition_penalty seed num_speculative_tokens n best_of stop stop_token_ids stream stream_options logprobs
    top_logprobs logit_bias echo suffix tools tool_choice response_format messages user cache_salt
    reasoning_effort thinking_token_budget""".split()


def _values(rng: random.Random) -> list:
    return [*NUMBERS, *OTHERS, rng.choice(["\\ud800", "NaN"]), [rng.randrange(-5, 2**33) for _ in range(3)]]


def test_no_field_value_gets_a_500(door):
    """Every field of a small valid body, in turn, set to each value of a table of JSON values of
    every type and edge (both routes, max_tokens kept at 1 so that a valid body is quick)."""
    r, _, _ = door
    rng = random.Random(0)
    seen = {}
    for path, base in (
        ("/v1/completions", {"model": "m", "prompt": [1, 2], "max_tokens": 1}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ):
        for f in FIELDS:
            for v in _values(rng):
                body = json.dumps({**base, f: v}, allow_nan=True).replace('"\\\\ud800"', '"\\ud800"').encode()
                status, out = post(r.http_port, body, path)
                seen[status] = seen.get(status, 0) + 1
                assert status in (200, 400, 404), (path, f, v, status, out)
                if status != 200:
                    assert out["error"]["message"] and "internal" not in out["error"]["message"], (f, v, out)
    assert seen.get(200) and seen.get(400), seen
    wait_for(lambda: r.service.active == 0, 10, "nothing in flight")


MESSAGES_FIELDS = """model max_tokens messages system stop_sequences stream temperature top_p top_k tools
    tool_choice thinking output_config output_format metadata cache_salt logit_bias mcp_servers""".split()
BLOCK_KEYS = "type text source tool_use_id content id name input thinking".split()


def test_no_messages_value_gets_a_500(door):
    """The same for Anthropic's /v1/messages (and count_tokens): every top-level field, and every
    key of a user's and an assistant's content block, set to each value of the table."""
    r, _, _ = door
    rng = random.Random(1)
    seen: dict[int, int] = {}
    base = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    bodies = [{**base, f: v} for f in MESSAGES_FIELDS for v in _values(rng)]
    bodies += [{**base, "thinking": {"type": "enabled", "budget_tokens": v}} for v in _values(rng)]
    for role in ("user", "assistant"):
        for k in BLOCK_KEYS:
            for v in _values(rng):
                turn = {"role": role, "content": [{"type": "text", "text": "hi", k: v}]}
                bodies.append({**base, "messages": [*base["messages"], turn] if role == "assistant" else [turn]})
    for i, b in enumerate(bodies):
        path = "/v1/messages/count_tokens" if i % 5 == 0 else "/v1/messages"
        body = json.dumps(b, allow_nan=True).replace('"\\\\ud800"', '"\\ud800"').encode()
        status, out = post(r.http_port, body, path)
        seen[status] = seen.get(status, 0) + 1
        assert status in (200, 400, 404), (path, b, status, out)
        if status != 200:
            assert out["type"] == "error" and out["error"]["message"], (b, out)
            assert "internal" not in out["error"]["message"], (b, out)
    assert seen.get(200) and seen.get(400), seen
    wait_for(lambda: r.service.active == 0, 10, "nothing in flight")


RESPONSES_FIELDS = """model input instructions tools tool_choice parallel_tool_calls max_output_tokens
    temperature top_p stream text reasoning previous_response_id metadata seed top_k logit_bias""".split()
ITEM_KEYS = "type role content call_id name arguments output summary".split()


def test_no_responses_value_gets_a_500(door):
    """The same for /v1/responses: every top-level field, and every key of an input item."""
    r, _, _ = door
    rng = random.Random(2)
    seen: dict[int, int] = {}
    base = {"model": "m", "max_output_tokens": 1, "input": "hi"}
    bodies = [{**base, f: v} for f in RESPONSES_FIELDS for v in _values(rng)]
    for k in ITEM_KEYS:
        for v in _values(rng):
            bodies.append({**base, "input": [{"type": "message", "role": "user", "content": "hi", k: v}]})
    for b in bodies:
        body = json.dumps(b, allow_nan=True).replace('"\\\\ud800"', '"\\ud800"').encode()
        status, out = post(r.http_port, body, "/v1/responses")
        seen[status] = seen.get(status, 0) + 1
        assert status in (200, 400, 404), (b, status, out)
        if status != 200:
            assert out["error"]["message"] and "internal" not in out["error"]["message"], (b, out)
    assert seen.get(200) and seen.get(400), seen
    wait_for(lambda: r.service.active == 0, 10, "nothing in flight")


CUSTOM_KEYS = "name description format".split()
GRAMMAR_KEYS = "type syntax definition grammar".split()


def test_no_custom_tool_value_gets_a_500(door):
    """The same for custom tools (router/custom_tools.py): every key of a chat custom tool, of its
    grammar format, of a custom call in the history, and of the Responses forms (flat tool,
    `custom_tool_call` item), with the tool named by tool_choice."""
    r, _, _ = door
    rng = random.Random(3)
    seen: dict[int, int] = {}
    grammar = {"syntax": "lark", "definition": 'start: "a"'}
    tool = {"name": "t", "format": {"type": "grammar", "grammar": grammar}}
    user = [{"role": "user", "content": "hi"}]
    chat = {"model": "m", "max_tokens": 1, "messages": user, "tool_choice": {"type": "custom", "custom": {"name": "t"}}}
    flat = {"type": "custom", "name": "t", "format": {"type": "grammar", **grammar}}
    resp = {"model": "m", "max_output_tokens": 1, "input": "hi", "tool_choice": {"type": "custom", "name": "t"}}
    bodies: list[tuple[str, dict]] = []
    for v in _values(rng):
        for k in CUSTOM_KEYS:
            bodies.append(("/v1/chat/completions", {**chat, "tools": [{"type": "custom", "custom": {**tool, k: v}}]}))
        for k in GRAMMAR_KEYS:
            fmt = {"type": "grammar", "grammar": {**grammar, k: v}}
            bodies.append(
                ("/v1/chat/completions", {**chat, "tools": [{"type": "custom", "custom": {**tool, "format": fmt}}]})
            )
            bodies.append(("/v1/responses", {**resp, "tools": [{**flat, "format": {**flat["format"], k: v}}]}))
        for k in ("name", "input", "custom"):
            call = {"id": "c", "type": "custom", "custom": {"name": "t", "input": "a", k: v}}
            if k == "custom":
                call["custom"] = v
            turn = {"role": "assistant", "content": None, "tool_calls": [call]}
            bodies.append(("/v1/chat/completions", {**chat, "messages": [*user, turn], "tool_choice": "auto"}))
        for k in ("name", "input", "call_id"):
            item = {"type": "custom_tool_call", "call_id": "c", "name": "t", "input": "a", k: v}
            bodies.append(("/v1/responses", {**resp, "input": [*user, item], "tools": [flat], "tool_choice": "auto"}))
        bodies.append(("/v1/responses", {**resp, "tools": [flat], "tool_choice": {"type": "custom", "name": v}}))
    for path, b in bodies:
        body = json.dumps(b, allow_nan=True).replace('"\\\\ud800"', '"\\ud800"').encode()
        status, out = post(r.http_port, body, path)
        seen[status] = seen.get(status, 0) + 1
        assert status in (200, 400, 404), (path, b, status, out)
        if status != 200:
            assert out["error"]["message"] and "internal" not in out["error"]["message"], (b, out)
    assert seen.get(200) and seen.get(400), seen
    wait_for(lambda: r.service.active == 0, 10, "nothing in flight")
