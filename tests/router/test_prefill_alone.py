"""PrefillPhase.alone (router/prefill.py) against a stand-in prefill node's stub (a gRPC stub is
all the method touches): the first message is the answer; a node that fails the call in a way
another placement mends (gone, draining, an earlier release that wants a target) gives None, so
the request is placed again the usual way, and what was counted against the node is given back;
a bad request is an Abort naming the node's reason."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto import pb
from router.config import RouterConfig
from router.errors import Abort
from router.policy import make_policy
from router.prefill import PrefillPhase
from router.registry import NodeRegistry


class _Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return ()


class _Call:
    def __init__(self, answer):
        self.answer, self.cancelled = answer, False

    async def read(self):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def cancel(self):
        self.cancelled = True


class _Stub:
    def __init__(self, answer):
        self.answer, self.requests = answer, []

    def Prefill(self, req, timeout=None):
        self.requests.append(req)
        return _Call(self.answer)


def _run(answer):
    reg = NodeRegistry()
    p = reg.register(pb.NodeInfo(node_id="p", kind=pb.NODE_KIND_PREFILL, prefill_ready=True))
    stub = _Stub(answer)
    p._stub = stub
    phase = PrefillPhase(RouterConfig(), reg, make_policy("least-loaded"), lambda coro: None)
    chosen = phase.choose(None, 40, set(), window=True)
    assert chosen is not None and chosen[0] is p and p.inflight_prefill_tokens == 40
    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=1))

    async def go():
        return await phase.alone(chosen, req, list(range(40)), "r1")

    try:
        return asyncio.run(go()), p, stub
    finally:
        assert p.inflight_prefill_tokens == 0  # given back whatever happened


def test_the_first_message_is_the_answer_and_no_target_is_sent():
    first = pb.PrefillResponse(first_token_id=7, finish_reason="length")
    got, p, stub = _run(first)
    assert got == first and not stub.requests[0].HasField("target") and p.alive


@pytest.mark.parametrize(
    "err,alive",
    [
        (_Err(grpc.StatusCode.UNAVAILABLE, "connection refused"), False),
        (_Err(grpc.StatusCode.INVALID_ARGUMENT, "a TransferTarget with every destination rank is required"), True),
        (_Err(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"), True),
    ],
)
def test_a_failure_another_placement_mends_gives_none(err, alive):
    got, p, _ = _run(err)
    assert got is None and p.alive == alive


def test_a_node_that_does_not_end_it_gives_none():
    got, _, _ = _run(pb.PrefillResponse(first_token_id=7))  # no finish_reason: it would push
    assert got is None


def test_a_bad_request_is_an_abort_with_the_nodes_reason():
    with pytest.raises(Abort) as e:
        _run(_Err(grpc.StatusCode.INVALID_ARGUMENT, "images[0]: not an image"))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "images[0]" in e.value.msg
