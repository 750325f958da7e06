"""The router blames the right node when a pair's transfer handshake fails: a prefill node that
answers that the decode node's transfer agent is unreachable (`pdserve-peer-unreachable`) is
healthy; the decode node is marked unreachable and the request goes to another decode node.
Fake nodes (real gRPC servers on loopback) register and heartbeat as real nodes do."""

from __future__ import annotations

import threading
import time

from proto import pb, rpc
from serving.rpc import refuse_peer, start_server
from tests.helpers.fake_node import FakeDecode, decode_info, heartbeat
from tests.helpers.serve_harness import wait_for


class _Decode(FakeDecode):
    def __init__(self, node_id: str, token: int):
        super().__init__([token])
        self.node_id = node_id

    def Handshake(self, request, context):
        return pb.HandshakeResponse(node_id=self.node_id, incarnation=1, schema=b"schema-" + self.node_id.encode())


class _Prefill(rpc.PrefillNodeServicer):
    """Answers the router's ask; refuses d0's blobs as unreachable, and before the second such
    refusal (the request's, after the early handshake's) calls `before_second`."""

    def __init__(self, before_second):
        self.calls: list[str] = []
        self.before_second = before_second
        self.lock = threading.Lock()

    def Handshake(self, request, context):
        with self.lock:
            self.calls.append(request.node_id)
            n = self.calls.count("d0")
        if request.node_id == "d0":
            if n == 2:
                self.before_second()
            refuse_peer(
                context, "d0", "prefill node p0: handshake with d0 failed: transfer agent d0.r0 of d0 unreachable"
            )
        return pb.HandshakeResponse(node_id="p0", incarnation=1, schema=b"schema-p0")


class _Nodes:
    """The fake nodes' gRPC servers and heartbeats, for one router: `pair` registers a decode node
    and a prefill node whose states can go to each other; `stop` ends them all."""

    def __init__(self, port: int):
        self.port = port
        self.servers: list = []
        self.beats: list = []

    def start(self, servicer, add, name) -> str:
        srv, port, _ = start_server("127.0.0.1:0", lambda s: add(servicer, s), [name])
        self.servers.append(srv)
        return f"127.0.0.1:{port}"

    def pair(self, d, p) -> None:
        dinfo = decode_info(self.start(d, rpc.add_DecodeNodeServicer_to_server, "DecodeNode"))
        pinfo = decode_info(self.start(p, rpc.add_PrefillNodeServicer_to_server, "PrefillNode"), node_id="p0")
        dinfo.schema_digest = pinfo.schema_digest = "same"
        pinfo.kind, pinfo.prefill_ready = pb.NODE_KIND_PREFILL, True
        self.beats += [heartbeat(f"127.0.0.1:{self.port}", dinfo, 0.1), heartbeat(f"127.0.0.1:{self.port}", pinfo, 0.1)]

    def join_other(self, d) -> None:
        """A decode node whose model a prefill node's state cannot go to: it computes prompts itself."""
        info = decode_info(self.start(d, rpc.add_DecodeNodeServicer_to_server, "DecodeNode"), node_id="d1")
        info.schema_digest = "other"
        self.beats.append(heartbeat(f"127.0.0.1:{self.port}", info, 0.1))

    def stop(self) -> None:
        for b in self.beats:
            b.stop()
        for s in self.servers:
            s.stop(0)


def test_a_decode_agent_the_prefill_node_cannot_reach_blames_the_decode_node(ckpt, caplog):
    import logging

    from client import Client
    from router.server import RouterConfig, serve

    d0, d1 = _Decode("d0", 1), _Decode("d1", 2)
    r, port = serve("127.0.0.1:0", RouterConfig(model=str(ckpt), heartbeat_interval_s=0.1, dead_after_s=600))
    nodes = _Nodes(port)

    def join_d1():  # a second decode node, with a model P's state cannot go to: it computes prompts itself
        nodes.join_other(d1)
        wait_for(lambda: "d1" in r.registry.nodes, 10, "d1 registered")

    p = _Prefill(join_d1)
    caplog.set_level(logging.WARNING, logger="pdserve.router")
    try:
        nodes.pair(d0, p)
        wait_for(lambda: p.calls.count("d0") == 1, 10, "the early handshake refused")
        with Client(f"127.0.0.1:{port}", timeout=20) as c:
            got = c.generate(prompt_token_ids=[1, 2, 3], max_tokens=4, admission_timeout_s=0)
        assert got.token_ids == [2, 2, 2, 2] and got.decode_node == "d1", got
        assert not d0.seen  # d0 got no request: its pair could not hand off
        entry = r.registry.nodes["p0"]
        assert entry.alive and not entry.unreachable  # the prefill node that answered is healthy
        assert "node d0 unreachable" in caplog.text and "node p0 unreachable" not in caplog.text
    finally:
        nodes.stop()
        r.stop(0)


class _HungDecode(_Decode):
    """A decode node that hangs in every Handshake (a process stopped mid-handshake) until `go`."""

    def __init__(self):
        super().__init__("d0", 1)
        self.go = threading.Event()
        self.shakes = 0

    def Handshake(self, request, context):
        with self.lock:
            self.shakes += 1
        self.go.wait(30)
        return super().Handshake(request, context)


def test_a_decode_node_hung_in_the_handshake_is_given_up_once_declared_dead(ckpt):
    """The pair's handshake waits on a decode node that hangs: once the heartbeats declare it dead
    the request waiting for the pair goes to another decode node within seconds, where it waited
    out the handshake's 60 s (the client's deadline first); the prefill node is not blamed."""
    from client import Client
    from router.server import RouterConfig, serve

    d0, d1 = _HungDecode(), _Decode("d1", 2)
    p = _Prefill(lambda: None)
    r, port = serve("127.0.0.1:0", RouterConfig(model=str(ckpt), heartbeat_interval_s=0.1, dead_after_s=1.0))
    nodes = _Nodes(port)
    try:
        nodes.pair(d0, p)
        wait_for(lambda: d0.shakes == 1, 10, "the early handshake to reach the decode node")

        def then():  # d0's heartbeats stop while the request waits; d1 (its own model: no pair) joins
            nodes.beats[0].stop()
            nodes.join_other(d1)

        threading.Timer(0.5, then).start()
        t0 = time.monotonic()
        with Client(f"127.0.0.1:{port}", timeout=20) as c:
            got = c.generate(prompt_token_ids=[1, 2, 3], max_tokens=4, admission_timeout_s=0)
        took = time.monotonic() - t0
        assert got.token_ids == [2, 2, 2, 2] and got.decode_node == "d1", got
        assert took < 8, took  # 0.5 s, the 1 s dead_after_s and a watch's poll
        assert r.registry.nodes["p0"].alive and not r.registry.nodes["p0"].unreachable
        assert not d0.seen
    finally:
        d0.go.set()
        nodes.stop()
        r.stop(0)
