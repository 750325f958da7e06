"""router/migrate.py on its own: which decode failures move a request, the --max-migrations bound
and its error, the metrics, and the watcher that turns heartbeat loss into a failure."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry

from router.errors import Abort
from router.migrate import Migration, MigrationMetrics, Moved, NodeWatch, Tried, cause_of
from serving.rpc import DRAINING_KEY


class _Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "", md: tuple = ()) -> None:
        self._code, self._details, self._md = code, details, md

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._md


def test_only_a_nodes_failure_moves():
    assert cause_of(_Err(grpc.StatusCode.UNAVAILABLE, "Socket closed"), False) == "unavailable"
    assert cause_of(_Err(grpc.StatusCode.UNAVAILABLE, md=((DRAINING_KEY, "1"),)), False) == "draining"
    assert cause_of(_Err(grpc.StatusCode.CANCELLED), True) == "node_dead"
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED):
        assert cause_of(_Err(code), False) is None


def test_moves_up_to_the_limit_then_a_clear_error():
    reg = CollectorRegistry()
    m = Migration(2, MigrationMetrics(reg))
    m.move(_Err(grpc.StatusCode.INVALID_ARGUMENT), "decode-0", 5, False)  # not the node's: no move
    for node in ("decode-0", "decode-1"):
        with pytest.raises(Moved):
            m.move(_Err(grpc.StatusCode.UNAVAILABLE, "Socket closed"), node, 5, False)
    with pytest.raises(Abort) as e:
        m.move(_Err(grpc.StatusCode.UNAVAILABLE, "Socket closed"), "decode-2", 9, False)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "decode-2 failed after 9 tokens" in e.value.msg and "--max-migrations 2" in e.value.msg
    assert m.path == ["decode-0(unavailable@5)", "decode-1(unavailable@5)"]
    assert reg.get_sample_value("pdserve_router_migrations_total", {"cause": "unavailable"}) == 2
    assert reg.get_sample_value("pdserve_router_migrations_refused_total") == 1
    m.resumed()
    m.resumed()  # the gap is observed once per move
    assert reg.get_sample_value("pdserve_router_migration_gap_seconds_count") == 1


def test_zero_turns_it_off():
    m = Migration(0, MigrationMetrics(CollectorRegistry()))
    with pytest.raises(Abort, match="moved 0 time"):
        m.move(_Err(grpc.StatusCode.UNAVAILABLE), "decode-0", 1, False)


def test_the_watch_cancels_once_the_node_is_dead():
    async def run() -> tuple[bool, bool]:
        alive, cancelled = [True], []
        w = NodeWatch(lambda: alive[0], lambda: cancelled.append(1), 0.01)
        await asyncio.sleep(0.05)
        before = bool(cancelled)
        alive[0] = False
        await asyncio.sleep(0.05)
        w.stop()
        return before, w.lost and cancelled == [1]

    assert asyncio.run(run()) == (False, True)


class _Push:
    """What _decode_failed reads of a prefill node's push: its node and how it ended."""

    def __init__(self, error: grpc.RpcError) -> None:
        self.error, self.p = error, type("P", (), {"node_id": "prefill-0"})()

    async def wait(self, timeout: float) -> bool:
        return True


_D = SimpleNamespace(node_id="decode-0", info=SimpleNamespace(incarnation=1))


def _run(sent: list[int]):
    from router.request import RequestRun

    run = RequestRun.__new__(RequestRun)  # the decision alone: no service, no nodes
    run.sent, run.tried = sent, Tried()
    run.tried.add(_D)  # type: ignore[arg-type]
    run.tr = SimpleNamespace(n=len(sent), request_id="r1")  # type: ignore[assignment]
    run.migration = Migration(2, MigrationMetrics(CollectorRegistry()))
    return run


def test_a_prefill_node_lost_mid_push_moves_the_request_and_its_decode_node_may_take_it():
    """D gave up (ABORTED) because the push from a prefill node that died failed, after the first
    token went out: the request moves with that token as output, and D, not at fault, may take it."""
    d = _D
    run = _run([7])
    lost = _Push(_Err(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)"))
    with pytest.raises(Moved) as mv:
        asyncio.run(run._decode_failed(_Err(grpc.StatusCode.ABORTED, "the push failed"), d, lost))
    assert mv.value.node_id == "prefill-0" and d not in run.tried
    assert run.migration.path == ["prefill-0(unavailable@1)"]
    # a push that failed for the request's own reason still ends it, with the push's error
    run = _run([7])
    bad = _Push(_Err(grpc.StatusCode.INVALID_ARGUMENT, "bad state"))
    with pytest.raises(Abort, match="pushing the state from prefill-0 failed: bad state"):
        asyncio.run(run._decode_failed(_Err(grpc.StatusCode.ABORTED, "the push failed"), d, bad))


class _HungCall:
    """A Prefill stream whose node hangs after its first message: read() waits until cancel(),
    then raises CancelledError, as a cancelled grpc.aio call's read does."""

    def __init__(self) -> None:
        self.cancelled = False
        self._waiting: asyncio.Future | None = None

    async def read(self):
        self._waiting = asyncio.get_running_loop().create_future()
        return await self._waiting

    def cancel(self) -> None:
        self.cancelled = True
        if self._waiting is not None:
            self._waiting.cancel()


def test_a_push_from_a_prefill_node_declared_dead_fails_unavailable():
    """P hangs mid-push (its process alive, its heartbeats gone): once the registry marks it dead
    the push's reader cancels the call and fails the push UNAVAILABLE, which releases D's
    reservation and moves the request (above), instead of waiting for D's lease to end it ABORTED."""
    from proto import pb
    from router.prefill import Push

    async def run():
        p, d = SimpleNamespace(node_id="prefill-0", alive=True), SimpleNamespace(node_id="decode-0")
        failed: list[grpc.RpcError] = []

        async def on_fail(push, e) -> None:
            failed.append(e)

        tasks: list[asyncio.Task] = []
        call = _HungCall()

        def spawn(c) -> None:
            tasks.append(asyncio.get_running_loop().create_task(c))

        first = pb.PrefillResponse(first_token_id=5)
        push = Push(p, d, "r1", first, call, on_fail, spawn, 0.01)  # type: ignore[arg-type]
        alive_wait = await push.wait(0.1)
        p.alive = False
        return alive_wait, await push.wait(2.0), call.cancelled, push.error, failed

    alive_wait, ended, cancelled, error, failed = asyncio.run(run())
    assert not alive_wait and ended and cancelled  # read on while alive, cancelled once dead
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert "prefill node prefill-0 was declared dead" in error.details() and failed == [error]


def test_a_node_restarted_since_may_take_the_request_again():
    """The decode nodes a request was placed on are excluded at the incarnation they had: the same
    id back as a new incarnation (a restarted pod) holds nothing of the request and may take it."""
    tried = Tried()
    tried.add(_D)  # type: ignore[arg-type]
    again = SimpleNamespace(node_id="decode-0", info=SimpleNamespace(incarnation=2))
    other = SimpleNamespace(node_id="decode-1", info=SimpleNamespace(incarnation=1))
    assert _D in tried and again not in tried and other not in tried and len(tried) == 1
