"""A failed push makes the router handshake the (prefill, decode) pair again before its next
request (router/prefill.py, PrefillPhase.push_failed): another router that declared the decode
node dead has had the prefill node drop its transfer agents, and a router that kept the pair as
handshaken had every later push fail ('destination agent ... is not connected; add_peer first').
Against stand-in node stubs that count the Handshake calls (a gRPC stub is all the phase touches)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc

from proto import pb
from router.config import RouterConfig
from router.policy import make_policy
from router.prefill import PrefillPhase
from router.registry import NodeRegistry
from tests.router.test_prefill_alone import _Err


class _Node:
    def __init__(self, node_id: str):
        self.node_id = node_id
        self.shakes: list[str] = []
        self.released: list[str] = []

    async def Handshake(self, req, timeout=None):
        self.shakes.append(req.node_id)
        return pb.HandshakeResponse(node_id=self.node_id, incarnation=1, schema=b"schema-" + self.node_id.encode())

    async def Release(self, req, timeout=None):
        self.released.append(req.request_id)
        return pb.ReleaseResponse()


def test_a_failed_push_handshakes_the_pair_again():
    reg = NodeRegistry()
    p = reg.register(pb.NodeInfo(node_id="p", kind=pb.NODE_KIND_PREFILL, prefill_ready=True, incarnation=1))
    d = reg.register(pb.NodeInfo(node_id="d", kind=pb.NODE_KIND_DECODE, incarnation=2))
    p._stub, d._stub = _Node("p"), _Node("d")
    phase = PrefillPhase(RouterConfig(), reg, make_policy("least-loaded"), lambda coro: None)
    gone = "pushing the state to d failed: push did not open: destination agent d.r0 is not connected; add_peer first"

    async def go():
        await phase.handshake(p, d)
        await phase.handshake(p, d)  # made once per pair of incarnations
        assert (p._stub.shakes, d._stub.shakes) == (["router", "d"], ["p"])
        await phase.push_failed(SimpleNamespace(p=p, d=d, rid="r1"), _Err(grpc.StatusCode.ABORTED, gone))
        await phase.handshake(p, d)

    asyncio.run(go())
    assert d._stub.released == ["r1"] and p.alive  # ABORTED: P is not declared dead
    assert (p._stub.shakes, d._stub.shakes) == (["router", "d"] * 2, ["p"] * 2)  # made again
