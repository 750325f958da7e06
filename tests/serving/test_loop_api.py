"""serving/node.py `NodeServer.loop_api`, how an RPC handler calls the engine loop: a loop that
has stopped and a wait for the loop that runs out (one step took that long) both end the RPC with
UNAVAILABLE and a message that says what to do, never an exception gRPC reports as UNKNOWN."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import grpc
import pytest

from serving.commands import ShuttingDown
from serving.node import NodeServer


class Aborted(Exception):
    pass


class Context:
    """The part of grpc.ServicerContext that loop_api uses: abort raises, as gRPC's does."""

    def __init__(self):
        self.status: tuple[grpc.StatusCode, str] | None = None

    def abort(self, code: grpc.StatusCode, details: str):
        self.status = (code, details)
        raise Aborted(details)


def _call(fn):
    ctx = Context()
    node = SimpleNamespace(name="prefill-0")
    with pytest.raises(Aborted):
        NodeServer.loop_api(node, ctx, fn)  # type: ignore[arg-type]
    assert ctx.status is not None
    return ctx.status


def test_a_wait_that_runs_out_is_unavailable_with_what_to_do(caplog):
    busy: Future[int] = Future()  # the loop is in a long step: the result never comes in time
    code, msg = _call(lambda: busy.result(timeout=0.01))
    assert code is grpc.StatusCode.UNAVAILABLE
    assert msg.startswith("prefill-0: ") and "try again" in msg and "--max-num-batched-tokens" in msg
    assert "did not answer in time" in caplog.text


def test_a_stopped_loop_is_unavailable():
    def stopped():
        raise ShuttingDown("the engine loop stopped")

    assert _call(stopped) == (grpc.StatusCode.UNAVAILABLE, "prefill-0: the engine loop stopped")


def test_an_answer_passes_through():
    assert NodeServer.loop_api(SimpleNamespace(name="n"), Context(), lambda: 7) == 7  # type: ignore[arg-type]
