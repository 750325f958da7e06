"""The router's one process, in-process against a fake decode node (a real gRPC server that
streams the tokens of a text, one every 20 ms, and records how each call ended): the same request through gRPC
and HTTP (streamed and whole) reaches the node once each; a client that goes away (gRPC cancel,
HTTP disconnect while streaming or while waiting for a whole answer) cancels the node's call and
leaves nothing in flight; the HTTP server answers without a delayed-ACK stall (TCP_NODELAY on
its connections); /metrics and /health on the HTTP app; unknown paths in OpenAI's error shape."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from proto import pb, rpc
from serving.rpc import start_server
from tests.helpers.fake_node import FakeDecode, decode_info
from tests.helpers.serve_harness import wait_for


@pytest.fixture()
def cluster(ckpt):
    from engine.tokenizer import Tokenizer
    from router.server import RouterConfig, serve

    fake = FakeDecode(Tokenizer(ckpt).encode(" and so on"))
    srv, nport, _ = start_server("127.0.0.1:0", lambda s: rpc.add_DecodeNodeServicer_to_server(fake, s), ["DecodeNode"])
    r, port = serve("127.0.0.1:0", RouterConfig(model=str(ckpt), dead_after_s=600.0, http_port=0))
    r.registry.register(decode_info(f"127.0.0.1:{nport}"))
    yield r, port, fake
    r.stop(0)
    srv.stop(0)


def _body(max_tokens: int, stream: bool = False) -> str:
    return json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": stream})


def _idle(r, fake, n: int) -> None:
    wait_for(lambda: len(fake.calls) == n and r.service.active == 0, 10, f"{n} node calls ended, none in flight")


def test_grpc_and_http_reach_the_node_once_each(cluster):
    from client import Client

    r, port, fake = cluster
    with Client(f"127.0.0.1:{port}", timeout=30) as c:
        assert c.generate(prompt_token_ids=[1, 2, 3], max_tokens=3).token_ids == fake.tokens[:3]
    conn = http.client.HTTPConnection("127.0.0.1", r.http_port, timeout=30)
    conn.request("POST", "/v1/completions", _body(3), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    assert resp.status == 200 and out["usage"]["completion_tokens"] == 3, out
    assert out["choices"][0]["finish_reason"] == "length"
    conn.request("POST", "/v1/completions", _body(2, stream=True), {"Content-Type": "application/json"})
    events = conn.getresponse().read().decode().split("\n\n")
    assert events[-2] == "data: [DONE]" and json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "length"
    _idle(r, fake, 3)
    assert fake.calls == ["done"] * 3
    # health and metrics on the same app; the metrics counted all three
    conn.request("GET", "/health")
    assert json.loads(conn.getresponse().read()) == {"status": "ok", "decode_nodes": 1}
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    assert 'pdserve_router_requests_total{outcome="ok"} 3.0' in text
    conn.request("GET", "/nope")
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    assert resp.status == 404 and set(err) == {"message", "type", "param", "code"} and "/nope" in err["message"]
    conn.close()


def test_clients_that_go_away_cancel_the_node_call(cluster):
    from client import Client

    r, port, fake = cluster
    with Client(f"127.0.0.1:{port}", timeout=30) as c:  # gRPC: cancel after the first token
        s = c.stream(prompt_token_ids=[1, 2, 3], max_tokens=500)
        next(iter(s))
        s.cancel()
    _idle(r, fake, 1)
    # HTTP, streamed: disconnect after the first event
    sock = socket.create_connection(("127.0.0.1", r.http_port))
    body = _body(500, stream=True).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    got = b""
    while b"data: " not in got:  # the headers, then the first event
        got += sock.recv(65536)
    sock.close()
    _idle(r, fake, 2)
    # HTTP, whole answer: disconnect while it is being made
    sock = socket.create_connection(("127.0.0.1", r.http_port))
    body = _body(500).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    # the node is making it (a disconnect before the router called the node ends it with no call)
    wait_for(lambda: fake.started == 3 and r.service.active == 1, 10, "the request in flight on the node")
    sock.close()
    _idle(r, fake, 3)
    assert fake.calls == ["cancelled"] * 3
    e = r.registry.nodes["d0"]
    assert (e.inflight, e.inflight_blocks) == (0, 0)  # the router's own counts are back
    assert e.inflight_prefill_tokens == 0  # ... the prompts the node computed itself too


def test_a_prompt_the_decode_node_computes_counts_in_its_queue_until_its_first_token(cluster):
    """The router counts a prompt computed on the decode node against that node's queue from
    placement to its first token (the node's own reports lag by a heartbeat), then as gone from
    that queue until the next report; a request cancelled before its first token leaves the queue
    the same way and no count in flight."""
    from client import Client

    r, port, fake = cluster
    e = r.registry.nodes["d0"]
    e.reported()
    fake.delay_s = 0.5  # the first token comes 0.5 s after the call
    with Client(f"127.0.0.1:{port}", timeout=30) as c:
        s = iter(c.stream(prompt_token_ids=[1, 2, 3, 4, 5], max_tokens=2))
        wait_for(lambda: r.service.active == 1, 10, "the request in flight")
        assert (e.inflight_prefill_tokens, e.queued_prefill_tokens()) == (5, 5)  # nothing cached there
        next(s)
        assert (e.inflight_prefill_tokens, e.prefilled_tokens) == (0, 5)
        list(s)
        s = c.stream(prompt_token_ids=[1, 2, 3], max_tokens=2)
        wait_for(lambda: e.inflight_prefill_tokens == 3, 10, "the second request placed")
        wait_for(lambda: fake.started == 2, 10, "the second call at the node")  # a cancel before it: no call
        s.cancel()
    _idle(r, fake, 2)
    assert (e.inflight, e.inflight_prefill_tokens, e.prefilled_tokens) == (0, 0, 5 + 3)


def test_http_connections_do_not_wait_for_delayed_acks(cluster):
    """The body of a response must not sit behind its headers for the client's delayed ACK."""
    r, _, _ = cluster
    conn = http.client.HTTPConnection("127.0.0.1", r.http_port, timeout=30)
    conn.request("GET", "/health")
    conn.getresponse().read()
    (h,) = [h for h in r.router._https if h.port == r.http_port]
    socks = [c.transport.get_extra_info("socket") for c in list(h.server.server_state.connections)]
    assert socks and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in socks)
    conn.close()


def test_a_resumed_chat_continues_the_unfinished_choices_only(cluster):
    """Generation.Chat with `resume` (the SDK on its next router): a finished choice is not
    generated again, an unfinished one is sent to the node with its tokens as its output so far,
    and the usage counts the resumed tokens; a resume naming no choice of the answer is
    INVALID_ARGUMENT."""
    import grpc

    r, port, fake = cluster
    r.registry.nodes["d0"].info.vocab_size = 1024  # the chat template's tokens (decode_info says 100)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 6})
    done, part = fake.tokens[:3] * 2, fake.tokens[:2]
    req = pb.ChatRequest(
        body_json=body,
        resume=[pb.ChatResume(index=0, token_ids=done, finished=True), pb.ChatResume(index=1, token_ids=part)],
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = rpc.GenerationStub(ch)
        msgs = list(stub.Chat(req, timeout=30))
        assert fake.started == 1 and list(fake.last.resume_token_ids) == part  # choice 1 alone, after its tokens
        choices = [json.loads(m.choice_json) for m in msgs if m.choice_json]
        assert {c["index"] for c in choices} == {1}
        new = sum(len(m.token_ids) for m in msgs if m.choice_json)
        use = json.loads(msgs[-1].usage_json)
        assert use["completion_tokens"] == len(done) + len(part) + new and new > 0
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Chat(pb.ChatRequest(body_json=body, resume=[pb.ChatResume(index=5)]), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "resume" in e.value.details()


def test_a_resumed_stream_sends_the_text_its_first_router_held_for_a_stop_string(cluster):
    """Generate with `resume_token_ids`, and Chat with `resume`, after a stop string's start that
    the first router held back (its client never got it): the resumed stream sends that text
    first, so the client's text is the uncut stream's."""
    import grpc

    r, port, fake = cluster
    r.registry.nodes["d0"].info.vocab_size = 1024  # the tokenizer's ids (decode_info says 100)
    texts = [r.service.tokenizer.decode(fake.tokens[: i + 1]) for i in range(len(fake.tokens))]
    cut = 3  # the client has three tokens; the last one's text starts this stop string
    stop = texts[cut - 1][len(texts[cut - 2]) :].strip() + "\x07"
    assert stop != "\x07"

    def had(msgs) -> list:  # the messages a client had when its router failed after `cut` tokens
        return [m for i, m in enumerate(msgs) if sum(len(w.token_ids) for w in msgs[: i + 1]) <= cut]

    def text(msgs) -> str:  # a Generate stream's text, or a chat choice's (reasoning or content)
        if not msgs or isinstance(msgs[0], pb.GenerateResponse):
            return "".join(m.text for m in msgs)
        ds = [json.loads(m.choice_json)["delta"] for m in msgs]
        return "".join(d.get("reasoning_content") or d.get("content") or "" for d in ds)

    def check(whole: list, rest: list) -> None:
        before = had(whole)
        assert [t for m in before for t in m.token_ids] == fake.tokens[:cut]
        assert not text(before).endswith(stop[:-1])  # the start was held back
        assert text(before) + text(rest) == text(whole)

    sp = pb.SamplingParams(max_tokens=6, stop=[stop])
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stop": [stop]})
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = rpc.GenerationStub(ch)
        whole = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sp), timeout=30))
        req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sp, resume_token_ids=fake.tokens[:cut])
        check(whole, list(stub.Generate(req, timeout=30)))
        whole = [m for m in stub.Chat(pb.ChatRequest(body_json=body), timeout=30) if m.choice_json]
        chat = pb.ChatRequest(body_json=body, resume=[pb.ChatResume(index=0, token_ids=fake.tokens[:cut])])
        check(whole, [m for m in stub.Chat(chat, timeout=30) if m.choice_json])
