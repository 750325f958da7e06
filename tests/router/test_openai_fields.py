"""Request fields at the HTTP front door against what OpenAI's and vLLM's documentation say of them
(in process against a fake decode node, tests/helpers/front_door.py): the bounds on `stop`
(docs/api.md), seeds of any int64 wrapped into the engine's range, JSON null as "unset" on every
field OpenAI types "or null", /health without a decode node, `continue_final_message` alone,
`stream_options` without `stream`, a byte order mark, a text part that is not text, and the
routes of other kinds of model."""

from __future__ import annotations

import json

import pytest

from router.stops import MAX_STOP_CHARS, MAX_STOPS
from tests.helpers.front_door import get, post

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]


def _post(port: int, path: str = "/v1/completions", **body) -> tuple[int, dict]:
    body.setdefault("model", "m")
    if path == "/v1/completions":
        body.setdefault("prompt", [1, 2, 3])
    else:
        body.setdefault("messages", USER)
    body.setdefault("max_tokens", 1)
    return post(port, json.dumps(body).encode(), path)


def test_stop_strings_are_bounded_in_count_and_length(door):
    """At most MAX_STOPS strings of MAX_STOP_CHARS characters each (docs/api.md); more is a 400
    naming `stop`, on HTTP and on gRPC, rather than seconds of matching per chunk on the loop."""
    r, fake, port = door
    most = ["".join(chr(ord("a") + (i + k) % 26) for k in range(MAX_STOP_CHARS)) for i in range(MAX_STOPS)]
    status, out = _post(r.http_port, stop=most)
    assert status == 200, out
    assert len(fake.last.sampling.stop) == MAX_STOPS
    for stop, words in (
        ([f"{i:030d}" for i in range(100_000)], f"at most {MAX_STOPS}"),
        (most + ["x"], f"at most {MAX_STOPS}"),
        (["ok", "y" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS}"),
        ("y" * (MAX_STOP_CHARS + 1), f"at most {MAX_STOP_CHARS}"),
    ):
        for path in ("/v1/completions", CHAT):
            status, out = _post(r.http_port, path, stop=stop)
            assert status == 400 and out["error"]["param"] == "stop", out
            assert words in out["error"]["message"]

    from client import Client, PdserveError

    with Client(f"127.0.0.1:{port}", timeout=30) as c:
        with pytest.raises(PdserveError) as e:
            c.generate(prompt_token_ids=[1, 2], max_tokens=1, stop=most + ["x"])
    assert e.value.code.name == "INVALID_ARGUMENT" and f"at most {MAX_STOPS}" in e.value.message


SEEDS = 2**63  # the engine's seeds are [0, 2^63); vLLM's body takes any int64


@pytest.mark.parametrize(
    "seed,n,want",
    [
        (2**63 - 1, 3, [2**63 - 1, 0, 1]),  # seed + i, wrapped: not an int64 overflow (a 500)
        (-1, 2, [2**63 - 1, 0]),  # a negative seed, taken modulo 2^63
        (-(2**63), 1, [0]),
        (7, 2, [7, 8]),
    ],
)
def test_seeds_of_any_int64_wrap_into_the_engines_range(door, seed, n, want):
    r, fake, _ = door
    for path in ("/v1/completions", CHAT):
        before = len(fake.seen)
        status, out = _post(r.http_port, path, seed=seed, n=n)
        assert status == 200, out
        assert sorted(q.sampling.seed for q in fake.seen[before:]) == sorted(want)
    for bad in (2**63, -(2**63) - 1):
        status, out = _post(r.http_port, seed=bad)
        assert status == 400 and out["error"]["param"] == "seed", out


# OpenAI's "or null" fields (and vLLM's extensions, Optional there): null is the default
NULLABLE = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "priority",
    "cache_salt",
    "best_of",
    "suffix",
    "service_tier",
    "metadata",
    "store",
    "reasoning_effort",
    "echo",
]
CHAT_ONLY = ["add_generation_prompt", "continue_final_message", "chat_template_kwargs", "enable_thinking"]


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
def test_null_is_the_default(door, path):
    r, fake, _ = door
    fields = NULLABLE + (CHAT_ONLY if path == CHAT else [])
    status, plain = _post(r.http_port, path, max_tokens=2)
    assert status == 200, plain
    want = fake.last.sampling
    status, out = _post(r.http_port, path, max_tokens=2, **{f: None for f in fields if f != "max_tokens"})
    assert status == 200, out
    assert fake.last.sampling == want
    assert out["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    if path != CHAT:  # (chat's default, the whole context, is long at the fake node's pace)
        status, out = _post(r.http_port, path, max_tokens=None)  # OpenAI's legacy default: 16
        assert status == 200 and out["usage"]["completion_tokens"] == 16, out
    status, out = _post(r.http_port, path, stream_options={"include_usage": None}, stream=True)
    assert status == 200 and out["events"][-2] == "data: [DONE]", out


def test_responses_take_null_as_unset(door):
    r, _, _ = door
    body = {"model": "m", "input": "Hi", "max_output_tokens": 2, "stream": None, "temperature": None}
    status, out = post(r.http_port, json.dumps(dict(body, seed=None, ignore_eos=None)).encode(), "/v1/responses")
    assert status == 200 and out["object"] == "response", out


def test_health_is_503_without_a_live_decode_node(ckpt):
    """A probe must not send traffic to a router whose every request would wait, then be a 503."""
    from router.server import RouterConfig, serve

    r, _ = serve("127.0.0.1:0", RouterConfig(model=str(ckpt), http_port=0))
    try:
        for path in ("/health", "/ping"):
            status, out = get(r.http_port, path)
            assert status == 503 and out["status"] == "no_decode_node" and out["decode_nodes"] == 0, out
            assert out["message"] == "no decode node is ready: start one or wait"
    finally:
        r.stop(0)


def test_health_is_200_with_a_decode_node(door):
    r, _, _ = door
    assert get(r.http_port, "/health") == (200, {"status": "ok", "decode_nodes": 1})


def _prompt(port: int, **chat) -> tuple[int, dict]:
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello, I am"}]
    return post(port, json.dumps({"model": "m", "messages": msgs, **chat}).encode(), "/tokenize")


def test_continue_final_message_alone_continues_it(door):
    """vLLM: add_generation_prompt follows continue_final_message unless sent; both sent true is a 400."""
    r, _, _ = door
    status, alone = _prompt(r.http_port, continue_final_message=True)
    assert status == 200, alone
    assert alone == _prompt(r.http_port, continue_final_message=True, add_generation_prompt=False)[1]
    status, text = post(r.http_port, json.dumps({"tokens": alone["tokens"]}).encode(), "/detokenize")
    assert text["prompt"].endswith("Hello, I am"), text
    status, out = _prompt(r.http_port, continue_final_message=True, add_generation_prompt=True)
    assert status == 400 and out["error"]["param"] == "continue_final_message", out
    status, out = _post(
        r.http_port, CHAT, messages=USER + [{"role": "assistant", "content": "{"}], **{"continue_final_message": True}
    )
    assert status == 200, out


def test_stream_options_only_with_stream(door):
    r, _, _ = door
    for stream in ({}, {"stream": False}):
        for path in ("/v1/completions", CHAT):
            status, out = _post(r.http_port, path, stream_options={"include_usage": True}, **stream)
            assert status == 400 and out["error"]["param"] == "stream_options", out
    status, out = _post(r.http_port, stream_options={"include_usage": True}, stream=True)
    assert status == 200 and '"usage"' in out["events"][-3], out


def test_a_body_with_a_byte_order_mark_is_json(door):
    r, _, _ = door
    body = b"\xef\xbb\xbf" + json.dumps({"model": "m", "prompt": [1, 2], "max_tokens": 1}).encode()
    status, out = post(r.http_port, body)
    assert status == 200 and out["usage"]["completion_tokens"] == 1, out


def test_a_text_part_must_hold_a_string(door):
    r, _, _ = door
    msgs = [{"role": "user", "content": [{"type": "text", "text": 123}]}]
    status, out = _post(r.http_port, CHAT, messages=msgs)
    assert status == 400 and out["error"]["param"] == "messages[0].content[0].text", out
    assert "must be a string" in out["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/audio/transcriptions", "/v1/images/generations"])
def test_other_kinds_of_model_are_a_404_saying_so(door, path):
    r, _, _ = door
    status, out = post(r.http_port, json.dumps({"model": "m", "input": "x"}).encode(), path)
    assert status == 404 and set(out["error"]) == {"message", "type", "param", "code"}, out
    assert out["error"]["param"] is None and "generation only" in out["error"]["message"]


def _content(out: dict) -> list[str]:
    """Each choice's content: a whole answer's, or a stream's deltas joined."""
    if "events" not in out:
        return [c["message"]["content"] for c in out["choices"]]
    got: dict[int, str] = {}
    for ev in out["events"]:
        if ev.startswith("data: {"):
            for c in json.loads(ev[6:])["choices"]:
                got[c["index"]] = got.get(c["index"], "") + (c["delta"].get("content") or "")
    return [got[i] for i in sorted(got)]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_puts_the_last_message_first(door, stream):
    """vLLM's `echo` on chat: each choice's content starts with the last message's text when that
    message has the answer's role (an assistant message continued; any last message without a
    generation prompt), else is as without echo; streamed, a choice's deltas join to the same."""
    r, _, _ = door
    ask = [{"role": "user", "content": "Say hi"}]
    part = [{"role": "assistant", "content": [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "I am"}]}]
    no_think = {"chat_template_kwargs": {"enable_thinking": False}, "n": 2, "max_tokens": 3, "stream": stream}
    for msgs, kw, echo in (
        (ask + [{"role": "assistant", "content": "Hello, I am"}], {"continue_final_message": True}, "Hello, I am"),
        (ask + part, {"continue_final_message": True}, "Hello,\nI am"),  # text parts joined by newlines
        (ask, {"add_generation_prompt": False}, "Say hi"),  # no generation prompt: the last message's role
        (ask, {}, ""),  # a user message before the assistant's answer: nothing echoed
    ):
        status, plain = _post(r.http_port, CHAT, messages=msgs, **kw, **no_think)
        assert status == 200, plain
        status, out = _post(r.http_port, CHAT, messages=msgs, echo=True, **kw, **no_think)
        assert status == 200, out
        assert _content(out) == [echo + c for c in _content(plain)] and len(_content(out)) == 2, (msgs, kw)
