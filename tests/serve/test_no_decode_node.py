"""What every front door of a real router on loopback says while no decode node takes requests:
HTTP /v1/* and /health 503, gRPC Generate UNAVAILABLE, the gRPC readiness NOT_SERVING, each
saying what is missing in one line (router/errors.py NO_DECODE), and the router stays up to serve
the next decode node. Two ways to get there: none ever registered, and the last one gone without a
word (a crash: no drain, no deregistration, heartbeats not yet missed), where a request used to
get the node's raw "Connection refused"."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import pb
from router.errors import NO_DECODE
from tests.helpers.serve_harness import wait_for

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROMPT = {"prompt": [5, 6, 7], "max_tokens": 2}


def _post(port: int, path: str, body: dict) -> tuple[int, str]:
    """(HTTP status, the error message or '') of a POST."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, ""
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]["message"]


def _health(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return resp.status, ""
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["message"]


def _generate(addr: str) -> tuple[grpc.StatusCode, str]:
    from client import Client, PdserveError

    with Client(addr, timeout=30) as c:
        try:
            c.generate(prompt_token_ids=PROMPT["prompt"], max_tokens=2)
        except PdserveError as e:
            return e.code, e.message
    return grpc.StatusCode.OK, ""


def _not_ready(addr: str) -> bool:
    with grpc.insecure_channel(addr) as ch:
        req = health_pb2.HealthCheckRequest(service="pdserve.v1.Generation")
        return health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status == NOT_SERVING


@pytest.fixture
def router(ckpt):
    from router.server import RouterConfig, serve

    # heartbeats missed for 60 s before a node is dead: a crashed node stays registered throughout
    cfg = RouterConfig(
        model=str(ckpt), heartbeat_interval_s=0.2, dead_after_s=60, admission_timeout_s=0.5, http_port=0, metrics_port=0
    )
    r, port = serve("127.0.0.1:0", cfg)
    try:
        yield r, f"127.0.0.1:{port}"
    finally:
        r.stop(0)


def _decode(ckpt, addr: str, node_id: str = "decode-0"):
    from decode_node.config import DecodeNodeConfig
    from decode_node.server import serve

    cfg = DecodeNodeConfig(model=str(ckpt), dtype="float32", router=addr, heartbeat_interval_s=0.2, node_id=node_id)
    return serve("127.0.0.1:0", cfg)[0]


def _every_door_says_no_decode(r, addr: str, also: str = "") -> None:
    for path, body in (
        ("/v1/completions", PROMPT),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ):
        status, msg = _post(r.http_port, path, body)
        assert status == 503 and msg.startswith(NO_DECODE) and "\n" not in msg, (path, status, msg)
        assert "refused" not in msg.lower(), msg
    code, msg = _generate(addr)
    assert code == grpc.StatusCode.UNAVAILABLE and msg.startswith(NO_DECODE), (code, msg)
    assert also in msg
    assert _not_ready(addr)
    assert _health(r.http_port) == (503, NO_DECODE) == _health(r.metrics_port)


def test_no_decode_node_ever(router):
    r, addr = router
    _every_door_says_no_decode(r, addr)


def test_the_last_decode_node_crashed(router, ckpt):
    r, addr = router
    d = _decode(ckpt, addr)
    wait_for(lambda: r.registry.live(pb.NODE_KIND_DECODE), 60, "the decode node registered")
    assert _post(r.http_port, "/v1/completions", PROMPT) == (200, "")
    d.stop(0)  # its server gone, its heartbeats stopped, no word to the router
    assert r.registry.live(pb.NODE_KIND_DECODE), "still registered: the router learns it from a call"
    status, msg = _post(r.http_port, "/v1/completions", PROMPT)  # the first call to find it gone
    assert (status, msg) == (503, f"{NO_DECODE} (decode-0 stopped answering)")
    _every_door_says_no_decode(r, addr)
    d2 = _decode(ckpt, addr, "decode-1")  # the router is up: the next decode node serves
    try:
        wait_for(lambda: _post(r.http_port, "/v1/completions", PROMPT)[0] == 200, 60, "served again")
    finally:
        d2.stop(0)
