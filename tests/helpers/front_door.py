"""The router's HTTP front door in process against a fake decode node that heartbeats like a real
one (tests/helpers/fake_node.py), and a plain HTTP POST to it: the router tests' `door`."""

from __future__ import annotations

import http.client
import json

from proto import pb, rpc
from serving.rpc import start_server
from tests.helpers.fake_node import FakeDecode, decode_info, heartbeat
from tests.helpers.serve_harness import wait_for

CTX = 512  # the fake node's max_model_len: text prompts longer than 16 x CTX characters are refused


def start(ckpt, ctx: int = CTX, dead_after_s: float = 1.0, **cfg):
    """dead_after_s: 1 s by default, so a router loop blocked for a second shows (the tokenizer
    tests); the shared `door` takes longer, so a loaded CI host cannot kill its fake node."""
    from router.server import RouterConfig, serve

    fake = FakeDecode([5, 6, 7], delay_s=0.02)
    srv, nport, _ = start_server("127.0.0.1:0", lambda s: rpc.add_DecodeNodeServicer_to_server(fake, s), ["DecodeNode"])
    r, port = serve(
        "127.0.0.1:0",
        RouterConfig(model=str(ckpt), heartbeat_interval_s=0.1, dead_after_s=dead_after_s, http_port=0, **cfg),
    )
    hb = heartbeat(f"127.0.0.1:{port}", decode_info(f"127.0.0.1:{nport}", max_model_len=ctx, vocab_size=1024), 0.1)
    wait_for(lambda: r.registry.live(pb.NODE_KIND_DECODE), 10, "the fake node registered")
    return r, fake, srv, hb, port


def get(port: int, path: str, timeout: float = 30) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def post(port: int, body: bytes, path: str = "/v1/completions", timeout: float = 60) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        if resp.getheader("content-type", "").startswith("text/event-stream"):
            return resp.status, {"events": raw.decode().split("\n\n")}
        return resp.status, json.loads(raw) if raw else {}
    finally:
        conn.close()
