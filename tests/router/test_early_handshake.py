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
def _pair(ckpt, d, p, digests=("", "")):
    """The router, and fake decode node d ("d0") and prefill node p ("p0") registered and beating
    (their schema digests: `digests`); everything stopped after."""
    from router.server import RouterConfig, serve

    dsrv, dport, _ = start_server("127.0.0.1:0", lambda s: rpc.add_DecodeNodeServicer_to_server(d, s), ["DecodeNode"])
    psrv, pport, _ = start_server("127.0.0.1:0", lambda s: rpc.add_PrefillNodeServicer_to_server(p, s), ["PrefillNode"])
    r, port = serve("127.0.0.1:0", RouterConfig(model=str(ckpt), heartbeat_interval_s=0.1, dead_after_s=600.0))
    dinfo, prefill = decode_info(f"127.0.0.1:{dport}"), decode_info(f"127.0.0.1:{pport}", node_id="p0")
    dinfo.schema_digest, prefill.schema_digest = digests
    prefill.kind, prefill.prefill_ready = pb.NODE_KIND_PREFILL, True
    beats = [heartbeat(f"127.0.0.1:{port}", dinfo, 0.1), heartbeat(f"127.0.0.1:{port}", prefill, 0.1)]
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
