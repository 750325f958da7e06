"""A transfer handshake naming a peer whose transfer agent cannot be reached (its process exited)
ends with UNAVAILABLE naming that peer, marked as the peer's fault (`pdserve-peer-unreachable`),
and one log line on the node that answered: not an "Exception calling application" traceback and
INTERNAL, which the router blamed on the node that answered (a prefill node resumed from SIGSTOP
after its decode node had exited was marked dead). Real nodes, standalone, no router; the
prefill node at TP 1 and at TP 2, where the error is raised in a rank process and must reach the
node as itself, not as a rank's traceback (engine/executor.py, `crosses_ranks`)."""

from __future__ import annotations

import grpc
import pytest

from tests.helpers.serve_harness import Proc, creds, flags, wait_for


@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_handshake_with_an_exited_peer_names_it_and_blames_it(ckpt, prefill_tp):
    from proto import pb, rpc
    from serving.rpc import channel, peer_at_fault

    def node(kind: str, tp: int = 1) -> Proc:
        ready = rf"{kind} node \S+ listening on (\S+)"
        return Proc(kind, "--model", ckpt, *flags(dtype="float32", tp=tp), ready=ready, wait=False)

    d, p = node("decode"), node("prefill", prefill_tp)
    try:
        d.wait_ready()
        p.wait_ready()
        with channel(d.address, creds()) as ch:  # the decode node's rank blobs, as the router asks for them
            blobs = rpc.DecodeNodeStub(ch).Handshake(pb.HandshakeRequest(node_id="router"), timeout=30).schema
        assert d.stop() == 0  # its transfer agents are gone with it
        with channel(p.address, creds()) as ch, pytest.raises(grpc.RpcError) as ei:
            rpc.PrefillNodeStub(ch).Handshake(pb.HandshakeRequest(node_id="decode-0", schema=blobs), timeout=30)
        e = ei.value
        assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
        assert "decode-0" in e.details() and "unreachable" in e.details(), e.details()
        assert peer_at_fault(e) == "decode-0"
        # the node's log is read by a thread: its line may land just after the answer
        wait_for(lambda: "handshake with decode-0 failed" in p.output(), 10, "the node's log line")
        out = p.output()
        assert "Traceback" not in out and "Exception calling application" not in out, out
        assert out.count("handshake with decode-0 failed") == 1, out
    finally:
        for x in (p, d):
            x.stop()
