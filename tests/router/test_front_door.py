"""The router's HTTP front door, in process against a fake decode node that heartbeats like a real
one (tests/helpers/fake_node.py): every bad body of a table gets a 400 whose code and message name
what was wrong (size, encoding, JSON, depth, a lone surrogate, a prompt too long, a request that
expands beyond what the router takes), a fuzz of every field never gets a 500, a 20 MB prompt is
refused in under 100 ms while a small request streams on and the node stays alive, a long prompt
is tokenized off the event loop, and the largest documented request (64 prompts x n = 16) is
served by an idle router."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time

import pytest

from proto import pb
from tests.helpers.front_door import CTX, post, start
from tests.helpers.serve_harness import wait_for


def _js(**kw) -> bytes:
    return json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, **kw}).encode()


BAD = [
    ("not json", b'{"model": "m", "prompt": ', "invalid_json", "not valid JSON"),
    ("empty body", b"", "invalid_json", "empty"),
    ("latin-1 bytes", b'{"model": "m", "prompt": "caf\xe9"}', "invalid_encoding", "not UTF-8: byte 0xe9"),
    ("nested arrays", b"[" * 100_000 + b"]" * 100_000, "json_too_deep", "deeper than 64"),
    ("nested objects", b'{"a": ' * 65 + b"1" + b"}" * 65, "json_too_deep", "deeper than 64"),
    ("lone surrogate", b'{"model": "m", "prompt": "ab\\ud800"}', "invalid_unicode", "lone UTF-16 surrogate (\\ud800"),
    ("low surrogate", b'{"model": "m", "prompt": "\\udc00x"}', "invalid_unicode", "lone UTF-16 surrogate"),
    ("surrogate key", b'{"model": "m", "prompt": "a", "\\ud800": 1}', "invalid_unicode", "lone UTF-16 surrogate"),
    ("array body", b"[1, 2]", None, "JSON object"),
    ("prompt too long", _js(prompt="a" * (16 * CTX + 1)), "invalid_argument", f"limit of {16 * CTX:,} characters"),
    ("messages too long", None, "invalid_argument", "messages of"),
    ("expands beyond", _js(prompt=[[1]] * 8, n=16), "too_many_sequences", "expands to 128 sequences"),
    ("huge token id", _js(prompt=[10**30]), None, "prompt"),
    ("huge seed", _js(seed=2**70), None, "seed"),
    ("huge max_tokens", _js(max_tokens=2**70), None, "max_tokens"),
    ("huge top_k", _js(top_k=2**40), None, "top_k"),
    ("huge stop id", _js(stop_token_ids=[2**40]), None, "stop"),
    ("prompt_logprobs 21", _js(prompt_logprobs=21), None, "'prompt_logprobs' takes the number"),
    ("truncate 0", _js(truncate_prompt_tokens=0), None, "'truncate_prompt_tokens' must be -1"),
]


@pytest.mark.parametrize("name,body,code,words", BAD, ids=[b[0] for b in BAD])
def test_bad_bodies_get_a_400_naming_the_fault(door, name, body, code, words):
    r, _, _ = door
    path = "/v1/completions"
    if body is None:
        path = "/v1/chat/completions"
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a" * (16 * CTX + 1)}]}).encode()
    status, out = post(r.http_port, body, path)
    err = out["error"]
    assert status == 400 and words in err["message"], (status, out)
    assert code is None or err["code"] == code, err
    assert "no route" not in err["message"]


def test_a_long_grpc_prompt_is_refused_before_tokenizing(door):
    from client import Client, PdserveError

    _, _, port = door
    with Client(f"127.0.0.1:{port}", timeout=30) as c:
        t0 = time.monotonic()
        with pytest.raises(PdserveError) as e:
            c.generate(prompt="a" * 3_000_000, max_tokens=1)
        took = time.monotonic() - t0
    assert e.value.code.name == "INVALID_ARGUMENT" and f"limit of {16 * CTX:,} characters" in e.value.message
    assert took < 2.0, took  # a 3 MB message, unread by the tokenizer


def test_a_chunked_body_is_counted_as_it_arrives(door):
    """No Content-Length: the body is refused once it passes the limit (16 MiB by default)."""
    r, _, _ = door
    piece = b"x" * (1 << 20)
    conn = http.client.HTTPConnection("127.0.0.1", r.http_port, timeout=60)
    try:
        conn.request(
            "POST", "/v1/completions", iter([piece] * 17), {"Content-Type": "application/json"}, encode_chunked=True
        )
        resp = conn.getresponse()
        err = json.loads(resp.read())["error"]
    finally:
        conn.close()
    assert resp.status == 400 and err["code"] == "body_too_large", err
    assert "more than 16,777,216 bytes" in err["message"]


def test_a_body_declared_far_beyond_the_limit_is_not_read(door):
    r, _, _ = door
    sock = socket.create_connection(("127.0.0.1", r.http_port), timeout=30)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n{")
        got = b""
        while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
            more = sock.recv(65536)
            if not more:
                break
            got += more
    finally:
        sock.close()
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), got
    assert b"1,000,000,000,000 bytes" in body and b"body_too_large" in body


def test_a_surrogate_pair_is_text(door):
    r, _, _ = door
    status, out = post(r.http_port, b'{"model": "m", "prompt": "\\ud83d\\ude00", "max_tokens": 1}')
    assert status == 200 and out["usage"]["prompt_tokens"] > 0, out


def test_unknown_fields_are_logged_once(door, caplog):
    """A field a route does not know has no effect; the router says so once per field, not per request."""
    r, _, _ = door
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 1, "frobnicate_level": 3}
    with caplog.at_level(logging.WARNING, logger="pdserve.http"):
        for _ in range(3):
            assert post(r.http_port, json.dumps(body).encode())[0] == 200
    said = [m.getMessage() for m in caplog.records if "frobnicate_level" in m.getMessage()]
    assert said == [
        "/v1/completions: request field 'frobnicate_level' is not supported here and is ignored (logged once)"
    ]


def test_priority_in_the_body(door):
    """A body's `priority`: vLLM's integer (above 0 is batch, else interactive) or the class's name,
    as the nodes get it (SamplingParams.priority); anything else is a 400 naming it."""
    r, fake, _ = door
    batch, interactive = pb.PRIORITY_BATCH, pb.PRIORITY_INTERACTIVE
    cases = [(5, batch), (0, interactive), (-3, interactive), ("batch", batch), ("interactive", interactive)]
    for value, want in cases:
        assert post(r.http_port, _js(priority=value))[0] == 200
        assert fake.last.sampling.priority == want, value
    status, out = post(r.http_port, _js(priority="urgent"))
    assert status == 400 and out["error"]["param"] == "priority"


def test_version_and_ping(door):
    """GET /version is the installed distribution's version; /ping (GET or POST) answers as /health."""
    from importlib.metadata import version

    r, _, _ = door

    def call(method: str, path: str) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", r.http_port, timeout=30)
        conn.request(method, path)
        resp = conn.getresponse()
        out = resp.status, json.loads(resp.read())
        conn.close()
        return out

    assert call("GET", "/version") == (200, {"version": version("pdserve")})
    health = call("GET", "/health")
    assert health[0] == 200 and call("GET", "/ping") == health == call("POST", "/ping")


def test_http_requests_are_counted_by_route_and_status(door):
    """pdserve_router_http_requests_total{route, status}: an answered request, a bad body, an
    unknown path (`other`, whatever its name) and a model retrieve each count once."""
    from tests.helpers.serve_harness import scrape

    r, _, _ = door
    url = f"http://127.0.0.1:{r.http_port}/metrics"

    def counts() -> dict:
        m = scrape(url)
        return {k[1]: v for k, v in m.items() if k[0] == "pdserve_router_http_requests_total"}

    def key(route: str, status: int) -> tuple:
        return (("route", route), ("status", str(status)))

    before = counts()
    assert post(r.http_port, _js())[0] == 200
    assert post(r.http_port, b"{")[0] == 400
    for path in ("/v2/nothing", "/v2/other-thing", "/v1/models/m"):
        conn = http.client.HTTPConnection("127.0.0.1", r.http_port, timeout=30)
        conn.request("GET", path)
        conn.getresponse().read()
        conn.close()
    after = counts()
    for k, n in (
        (key("/v1/completions", 200), 1),
        (key("/v1/completions", 400), 1),
        (key("other", 404), 2),
    ):
        assert after.get(k, 0) - before.get(k, 0) == n, (k, before, after)
    assert (
        sum(v for k, v in after.items() if k[0][1] == "/v1/models/{id}")
        - sum(v for k, v in before.items() if k[0][1] == "/v1/models/{id}")
        == 1
    )


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_a_20mb_prompt_is_refused_at_once_while_a_small_request_streams(door):
    r, fake, _ = door
    got: list = []

    def small():  # about 40 x 20 ms of tokens, streamed, across the big requests below
        got.append(post(r.http_port, _js(max_tokens=40, stream=False)))

    t = threading.Thread(target=small)
    t.start()
    wait_for(lambda: r.service.active == 1, 10, "the small request in flight")
    big = json.dumps({"model": "m", "prompt": "hello world " * (20_000_000 // 12), "max_tokens": 1}).encode()
    rss0 = _rss_mb()
    times = []
    for _ in range(3):
        t0 = time.monotonic()
        status, out = post(r.http_port, big)
        times.append(time.monotonic() - t0)
        assert status == 400 and out["error"]["code"] == "body_too_large", out
        assert "--max-body-bytes" in out["error"]["message"]
    t.join(30)
    assert got and got[0][0] == 200 and got[0][1]["usage"]["completion_tokens"] == 40, got
    assert min(times) < 0.1, times  # on a loaded 2-core box the first may pay for a cold path
    assert all(e.alive for e, _ in r.registry.snapshot())
    assert _rss_mb() - rss0 < 200, "the router kept the refused bodies"


@pytest.mark.serial  # compares two latencies: run alone, not beside another test worker
def test_a_long_prompt_is_tokenized_off_the_event_loop(ckpt):
    """A prompt within every limit but long to tokenize (1 M characters here, under a raised
    limit): the loop stays free, so heartbeats keep the node alive and a small request finishes
    while the long one is being tokenized."""
    from engine.tokenizer import Tokenizer
    from router.text import INLINE_CHARS

    r, fake, srv, hb, _ = start(ckpt, ctx=10**6, max_prompt_chars=2 << 20)
    try:
        long_text = "hello world, how are you? " * 40_000
        assert len(long_text) > 100 * INLINE_CHARS
        got: list = []
        t = threading.Thread(target=lambda: got.append(post(r.http_port, _js(prompt=long_text))))
        t0 = time.monotonic()
        t.start()
        status, out = post(r.http_port, _js(prompt="short", max_tokens=2))
        small_s = time.monotonic() - t0
        t.join(120)
        long_s = time.monotonic() - t0
        assert status == 200 and out["usage"]["completion_tokens"] == 2, out
        assert all(e.alive for e, _ in r.registry.snapshot())
    finally:
        hb.stop()
        r.stop(0)
        srv.stop(0)
    # tokenized (the count is the tokenizer's own, computed here once the router is gone: a plain
    # encode holds this process's GIL for a second), then refused: no fake node holds it
    want = len(Tokenizer(ckpt).encode(long_text))
    assert got and got[0][0] == 400 and f"prompt of {want} tokens needs" in got[0][1]["error"]["message"], got
    assert small_s < long_s / 2, (small_s, long_s)
    print(f"small request {small_s * 1e3:.0f} ms while a 1 M-character prompt took {long_s * 1e3:.0f} ms")


def test_the_largest_documented_request_fits_an_idle_router(ckpt):
    """64 prompts x n = 16: 1,024 sequences, with the default admission queue."""
    from router.openai_models import MAX_BATCH, MAX_N

    r, fake, srv, hb, _ = start(ckpt)
    fake.delay_s = 0.001
    try:
        status, out = post(r.http_port, _js(prompt=[[1, 2]] * MAX_BATCH, n=MAX_N), timeout=300)
        assert status == 200, out
        assert len(out["choices"]) == MAX_BATCH * MAX_N == 1024
        assert all(c["finish_reason"] == "length" for c in out["choices"])
    finally:
        hb.stop()
        r.stop(0)
        srv.stop(0)


@pytest.mark.parametrize(
    "method,path,status", [("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405), ("GET", "/v2/nothing", 404)]
)
def test_wrong_method_and_unknown_path_say_which(door, method, path, status):
    r, _, _ = door
    conn = http.client.HTTPConnection("127.0.0.1", r.http_port, timeout=30)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        err = json.loads(resp.read())["error"]
        allow = resp.getheader("allow")
    finally:
        conn.close()
    assert resp.status == status, err
    if status == 405:
        assert "not allowed" in err["message"] and err["code"] == "method_not_allowed" and allow, (err, allow)
        assert allow.split(",")[0].strip() in err["message"]
    else:
        assert err["message"] == f"no route {method} {path}"


def test_served_model_names_are_the_names_clients_call(ckpt):
    """--served-model-name: the first is the id /v1/models lists (and retrieves, under any of the
    names) and the answers carry; every one of them (and the path's forms) reaches the model;
    another name is a 404 listing the id. The
    default name of a Hugging Face cache snapshot is its ORG/NAME."""
    from router.model_names import model_id

    r, fake, srv, hb, _ = start(ckpt, served_model_name=("Qwen/Qwen3.5-35B-A3B", "qwen"))
    port = r.http_port
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v1/models")
        listed = json.loads(conn.getresponse().read())["data"]
        assert [m["id"] for m in listed] == ["Qwen/Qwen3.5-35B-A3B"]
        for name, status in (("Qwen/Qwen3.5-35B-A3B", 200), ("qwen", 200), ("Qwen/Other", 404)):
            conn.request("GET", f"/v1/models/{name}")  # OpenAI's retrieve
            resp = conn.getresponse()
            got = json.loads(resp.read())
            assert resp.status == status, (name, got)
            assert got["id"] == "Qwen/Qwen3.5-35B-A3B" if status == 200 else got["error"]["code"] == "model_not_found"
        for name in ("Qwen/Qwen3.5-35B-A3B", "qwen", "/models/m", "m"):
            status, out = post(port, json.dumps({"model": name, "prompt": [1, 2], "max_tokens": 2}).encode())
            assert status == 200 and out["model"] == "Qwen/Qwen3.5-35B-A3B", (name, out)
        status, out = post(port, json.dumps({"model": "Qwen/Qwen3.5-122B", "prompt": [1], "max_tokens": 2}).encode())
        assert status == 404 and "serving: Qwen/Qwen3.5-35B-A3B" in out["error"]["message"]
    finally:
        hb.stop()
        r.stop(0)
        srv.stop(0)
    snap = "/root/.cache/huggingface/hub/models--Qwen--Qwen3.5-35B-A3B-FP8/snapshots/0a1b2c3d"
    assert model_id(snap) == "Qwen/Qwen3.5-35B-A3B-FP8" and model_id(snap + "/") == "Qwen/Qwen3.5-35B-A3B-FP8"
    assert model_id("/data/ckpts/Qwen3.5-35B-A3B") == "Qwen3.5-35B-A3B"


def test_schemas_that_do_not_compile_are_refused_naming_their_field(door):
    """A schema the output must follow that does not compile (an unknown type, at the top or in a
    parameter) is a 400 naming the field the client wrote, on chat, Responses and Anthropic
    Messages; under tool_choice auto, where no tool's schema is compiled, the same tools pass."""
    r, _, _ = door
    msgs = [{"role": "user", "content": "hi"}]
    inner = {"type": "object", "properties": {"mode": {"type": "strin"}}, "required": ["mode"]}
    good = {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}}
    for bad_schema in (inner, {"type": "objekt"}):
        tools = [good, {"type": "function", "function": {"name": "f", "parameters": bad_schema}}]
        body = {"model": "m", "messages": msgs, "max_tokens": 1, "tools": tools, "tool_choice": "required"}
        status, out = post(r.http_port, json.dumps(body).encode(), "/v1/chat/completions")
        assert status == 400 and out["error"]["param"] == "tools[1].function.parameters", out
        assert "Invalid type" in out["error"]["message"] and "start:" not in out["error"]["message"], out
        body["tool_choice"] = "auto"  # no schema compiled: served
        assert post(r.http_port, json.dumps(body).encode(), "/v1/chat/completions")[0] == 200
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    body = {"model": "m", "messages": msgs, "max_tokens": 1, "response_format": fmt}
    status, out = post(r.http_port, json.dumps(body).encode(), "/v1/chat/completions")
    assert status == 400 and out["error"]["param"] == "response_format" and "objekt" in out["error"]["message"]
    status, out = post(r.http_port, _js(structured_outputs={"regex": "a(b"}))
    assert status == 400 and out["error"]["param"] == "structured_outputs", out
    flat = [
        {"type": "function", "name": "ok", "parameters": {"type": "object"}},
        {"type": "function", "name": "f", "parameters": inner},
    ]
    body = {"model": "m", "input": "hi", "max_output_tokens": 1, "tools": flat, "tool_choice": "required"}
    status, out = post(r.http_port, json.dumps(body).encode(), "/v1/responses")
    assert status == 400 and out["error"]["param"] == "tools[1].parameters", out
    anth = [{"name": "f", "input_schema": inner}]
    body = {"model": "m", "messages": msgs, "max_tokens": 1, "tools": anth, "tool_choice": {"type": "any"}}
    status, out = post(r.http_port, json.dumps(body).encode(), "/v1/messages")
    assert status == 400 and "tools[0].input_schema" in out["error"]["message"], out


def test_a_body_without_a_model_is_served_by_the_one_model(door):
    """`model` left out (as vLLM's server allows): completions, chat and Responses are answered by
    the model the router serves, named in the answer; a wrong name is still a 404."""
    r, _, _ = door
    served = r.service.models()[0].id
    msgs = [{"role": "user", "content": "hi"}]
    for path, body in [
        ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": 1}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    ]:
        status, out = post(r.http_port, json.dumps(body).encode(), path)
        assert status == 200 and out["model"] == served, (path, out)
        status, out = post(r.http_port, json.dumps({**body, "model": "nope"}).encode(), path)
        assert status == 404 and out["error"]["param"] == "model", (path, out)


def test_a_client_request_id_names_the_answer_and_the_log_lines(door, caplog):
    """`X-Request-Id` (as vLLM's benchmark sends it): the answer's id is built on it, the router's
    log line and the node's request id start with it (a second request with the same id stays
    distinct), and an id that could forge log text is a 400 naming the header."""
    r, fake, _ = door
    body = _js()
    for _ in range(2):
        with caplog.at_level(logging.INFO, logger="pdserve.router"):
            conn = http.client.HTTPConnection("127.0.0.1", r.http_port, timeout=30)
            conn.request(
                "POST", "/v1/completions", body, {"Content-Type": "application/json", "X-Request-Id": "bench-7"}
            )
            resp = conn.getresponse()
            out = json.loads(resp.read())
            conn.close()
        assert resp.status == 200 and out["id"] == "cmpl-bench-7", out
    ids = [m.split()[1].rstrip(":") for m in caplog.messages if m.startswith("request bench-7-")]
    assert len(ids) == 2 and ids[0] != ids[1] and fake.last.request_id in ids
    conn = http.client.HTTPConnection("127.0.0.1", r.http_port, timeout=30)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json", "X-Request-Id": "a b;c"})
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    assert resp.status == 400 and "x-request-id" in err["message"]


def test_an_image_detail_outside_openais_values_is_named(door):
    r, _, _ = door
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "bogus"}}
    body = {"model": "m", "messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    status, out = post(r.http_port, json.dumps(body).encode(), "/v1/chat/completions")
    assert status == 400 and out["error"]["param"] == "messages[0].content[0].image_url.detail", out


def test_a_request_id_in_flight_is_refused_for_a_second_request(door):
    """Two requests under one client-given id: the second is refused ALREADY_EXISTS at once and
    the first streams on to its end (a second stream of the id took the first's tokens: it hung to
    its deadline); once it ended the id is free again."""
    from client import Client, PdserveError

    _, _, port = door
    with Client(f"127.0.0.1:{port}", timeout=30) as c:
        s = c.stream(prompt_token_ids=[1, 2, 3], max_tokens=40, ignore_eos=True, request_id="req-1")
        it = iter(s)
        got = list(next(it).token_ids)
        with pytest.raises(PdserveError) as e:
            c.generate(prompt_token_ids=[4, 5], max_tokens=2, request_id="req-1")
        assert e.value.code.name == "ALREADY_EXISTS" and "'req-1' is already in flight" in e.value.message
        for ch in it:
            got += ch.token_ids
        assert len(got) == 40
        assert len(c.generate(prompt_token_ids=[4, 5], max_tokens=2, request_id="req-1").token_ids) == 2


def _raw(port: int, method: str, path: str, headers: dict, body: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body, headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def test_browsers_may_call_from_any_origin_by_default(door):
    """CORS as vLLM's default (`--allowed-origins '*'`): a preflight OPTIONS is answered with the
    methods and headers asked for, and the call itself carries Access-Control-Allow-Origin."""
    r, _, _ = door
    asks = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    status, h = _raw(
        r.http_port,
        "OPTIONS",
        "/v1/chat/completions",
        {**asks, "Access-Control-Request-Headers": "authorization,content-type"},
    )
    assert status == 200 and h["access-control-allow-origin"] in ("*", "https://app.example"), h
    assert "POST" in h["access-control-allow-methods"] and "authorization" in h["access-control-allow-headers"].lower()
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    status, h = _raw(
        r.http_port,
        "POST",
        "/v1/completions",
        {"Origin": "https://app.example", "Content-Type": "application/json"},
        body,
    )
    assert status == 200 and h["access-control-allow-origin"] in ("*", "https://app.example"), h


def test_allowed_origins_restrict_cors(ckpt):
    r, fake, srv, hb, _ = start(ckpt, allowed_origins=("https://ok.example",))
    try:
        for origin, allowed in (("https://ok.example", True), ("https://evil.example", False)):
            _, h = _raw(r.http_port, "GET", "/v1/models", {"Origin": origin})
            assert (h.get("access-control-allow-origin") == origin) == allowed, (origin, h)
    finally:
        hb.stop()
        r.stop(0)
        srv.stop(0)
