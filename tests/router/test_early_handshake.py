"""The router brokers the transfer handshake of every (prefill node, decode node) pair as soon as
both have registered, before any request: a node's first requests do not wait for it. Against
fake nodes (real gRPC servers on loopback) that record the Handshake calls they get; the nodes
register and heartbeat through the Registry RPCs as real nodes do."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from proto import pb, rpc
from serving.rpc import start_server
from tests.helpers.fake_node import FakeDecode, decode_info, heartbeat
from tests.helpers.serve_harness import wait_for


class _Shake:
    """Handshake for either kind of fake node: records who asked, answers with its own schema."""

    def __init__(self, node_id: str):
        self.node_id, self.lock = node_id, threading.Lock()
        self.calls: list[str] = []

    def Handshake(self, request, context):
        with self.lock:
            self.calls.append(request.node_id)
        return pb.HandshakeResponse(node_id=self.node_id, incarnation=1, schema=b"schema-" + self.node_id.encode())


class _Decode(_Shake, FakeDecode):
    def __init__(self):
        _Shake.__init__(self, "d0")
        FakeDecode.__init__(self, [1])


class _Prefill(_Shake, rpc.PrefillNodeServicer):
    pass


@contextmanager
def _pair(ckpt, d, p, digests=("", ""), dead_after_s=600.0):
    """The router, and fake decode node d ("d0") and prefill node p ("p0") registered and beating
    (their schema digests: `digests`); everything stopped after. The router's port is `r.port`,
    the nodes' Heartbeaters `r.beats` (decode node's first)."""
    from router.server import RouterConfig, serve

    dsrv, dport, _ = start_server("127.0.0.1:0", lambda s: rpc.add_DecodeNodeServicer_to_server(d, s), ["DecodeNode"])
    psrv, pport, _ = start_server("127.0.0.1:0", lambda s: rpc.add_PrefillNodeServicer_to_server(p, s), ["PrefillNode"])
    r, port = serve("127.0.0.1:0", RouterConfig(model=str(ckpt), heartbeat_interval_s=0.1, dead_after_s=dead_after_s))
    dinfo, prefill = decode_info(f"127.0.0.1:{dport}"), decode_info(f"127.0.0.1:{pport}", node_id="p0")
    dinfo.schema_digest, prefill.schema_digest = digests
    prefill.kind, prefill.prefill_ready = pb.NODE_KIND_PREFILL, True
    beats = [heartbeat(f"127.0.0.1:{port}", dinfo, 0.1), heartbeat(f"127.0.0.1:{port}", prefill, 0.1)]
    r.port, r.beats = port, beats
    try:
        yield r
    finally:
        for b in beats:
            b.stop()
        r.stop(0)
        dsrv.stop(0)
        psrv.stop(0)


def test_a_registered_pair_is_handshaken_once_before_any_request(ckpt):
    d, p = _Decode(), _Prefill("p0")
    with _pair(ckpt, d, p) as r:
        # P is asked by the router, then D with P's schema, then P with D's: the router's order
        wait_for(lambda: len(p.calls) == 2 and len(d.calls) == 1, 10, "the pair's handshake without a request")
        assert p.calls == ["router", "d0"] and d.calls == ["p0"]
        time.sleep(0.5)  # five more heartbeats each: a made pair is not handshaken again
        assert len(p.calls) == 2 and len(d.calls) == 1
        assert r.service.active == 0


class _Refusing(_Decode):
    def Handshake(self, request, context):
        import grpc

        self.calls.append(request.node_id)
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "transfer handshake refused: recurrent_dtype differs")


def test_a_pair_whose_schemas_differ_is_named_once_with_the_reason(ckpt, caplog):
    """A prefill node whose state schema differs from the decode node's never gets its prompts
    (the decode node computes them): the router says so once, with the handshake's reason (the
    setting that differs), not silently."""
    import logging

    with (
        caplog.at_level(logging.WARNING, logger="pdserve.router"),
        _pair(ckpt, _Refusing(), _Prefill("p0"), ("aaaa", "bbbb")) as r,
    ):
        said = "prefill node p0 cannot hand prompts to decode node d0: "
        wait_for(lambda: said in caplog.text, 10, "the router to say why the pair is not used")
        time.sleep(0.5)  # more heartbeats and registrations: said once
        assert caplog.text.count(said) == 1 and "recurrent_dtype differs" in caplog.text
        assert not r.service.prefill.ready(r.registry.nodes["d0"], set())


class _Hung(_Prefill):
    """A prefill node that hangs in its first Handshake (a process stopped mid-handshake) until
    `go` is set."""

    def __init__(self, node_id: str):
        super().__init__(node_id)
        self.go = threading.Event()

    def Handshake(self, request, context):
        with self.lock:
            self.calls.append(request.node_id)
        self.go.wait(30)
        return pb.HandshakeResponse(node_id=self.node_id, incarnation=1, schema=b"schema-" + self.node_id.encode())


def test_a_prefill_node_hung_in_the_handshake_is_given_up_once_declared_dead(ckpt):
    """The pair's early handshake is under way when the prefill node hangs: a request for the pair
    waits behind it only until the heartbeats declare the node dead, then the decode node computes
    the prompt (its fake streams its tokens), within seconds; it waited out the handshake's 60 s
    before (the client's deadline first)."""
    from client import Client

    d, p = _Decode(), _Hung("p0")
    with _pair(ckpt, d, p, digests=("same", "same"), dead_after_s=1.0) as r:
        try:
            wait_for(lambda: p.calls == ["router"], 10, "the early handshake to reach the prefill node")
            assert r.service.prefill.ready(r.registry.nodes["d0"], set())  # alive: the request is sent to it
            threading.Timer(0.5, r.beats[1].stop).start()  # its heartbeats stop too, while the request waits
            t0 = time.monotonic()
            with Client(f"127.0.0.1:{r.port}", timeout=20) as c:
                got = c.generate(prompt_token_ids=[1, 2, 3], max_tokens=4, admission_timeout_s=0)
            took = time.monotonic() - t0
            assert got.token_ids == [1, 1, 1, 1] and got.prefill_node in ("", "local", "d0"), got
            assert d.seen and not d.seen[-1].reserved  # computed on the decode node, nothing reserved
            assert took < 8, took  # 0.5 s, the 1 s dead_after_s and a watch's poll
            assert p.calls == ["router"]  # never asked again while hung
        finally:
            p.go.set()
