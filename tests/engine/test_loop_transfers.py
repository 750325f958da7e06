"""The engine loop hands a connector's records to whoever waits (serving/loop.py): a prefilled
request's handle gets its push's end, await_transfer gets a reservation's RecvReady / RecvFailed,
a release is answered only once the memory is back, and a stop ends every wait with ShuttingDown.
The connector here is scripted: the test decides what each poll reports (queued on the loop
thread), over a real engine whose memory must come back on every path."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from engine import SamplingParams
from engine.connector import Connector, RecvFailed, RecvFreed, RecvReady, SendDone, TransferRecord
from engine.llm import LLM
from engine.request import Request
from serving.commands import ShuttingDown, UnknownRequest
from serving.loop import EngineLoop

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 40))


class Scripted(Connector):
    """Tracks the requests it is told of; each poll reports what the test queued."""

    def __init__(self) -> None:
        self.live: dict[str, TransferRecord | None] = {}
        self.queued: list[TransferRecord] = []
        self.aborted: list[tuple[str, str]] = []
        self.polls = 0
        self.reserved: set[str] = set()  # ids it took reservations for

    def prompt_prefilled(self, request: Request) -> None:
        self.live[request.request_id] = None

    def request_reserved(self, request: Request) -> object:
        self.live[request.request_id] = None
        self.reserved.add(request.request_id)
        return f"where to write {request.request_id}"

    def request_activating(self, request: Request) -> None:
        if not isinstance(self.live.get(request.request_id), RecvReady):
            raise RuntimeError("not ready")
        del self.live[request.request_id]

    def tracks(self, request_id: str) -> bool:
        return request_id in self.live

    def abort(self, request_id: str, reason: str) -> bool:
        self.aborted.append((request_id, reason))
        return request_id in self.live

    def current(self, request_id: str) -> TransferRecord | None:
        return self.live.get(request_id)

    def has_work(self) -> bool:
        return bool(self.live or self.queued)

    def writes_awaited(self) -> int:  # reserved and nothing reported yet: a prefill node computes it
        return sum(1 for rid in self.reserved if rid in self.live and self.live[rid] is None)

    def poll(self) -> list[TransferRecord]:
        self.polls += 1
        out, self.queued = self.queued, []
        for r in out:
            if isinstance(r, (SendDone, RecvFreed)):
                self.live.pop(r.request_id, None)
            else:
                self.live[r.request_id] = r
        return out


@pytest.fixture(scope="module")
def setup(ckpt_hv2):
    llm = LLM(ckpt_hv2, dtype="float32", max_num_seqs=4, max_model_len=512)
    conn = Scripted()
    llm.engine.use_connector(conn)
    yield llm.engine, conn
    llm.close()


@pytest.fixture
def loop(setup):
    engine, conn = setup
    conn.aborted.clear()
    lp = EngineLoop(engine, name="transfers").start()
    yield lp, conn
    lp.stop()


def _report(lp: EngineLoop, conn: Scripted, rec: TransferRecord) -> None:
    lp.call(lambda e: conn.queued.append(rec))  # on the loop thread, like every connector call


def _free(lp: EngineLoop) -> tuple[int, int]:
    s = lp.stats().result(5)
    return s.free_blocks, s.free_slots


def _prefilled(lp: EngineLoop, rid: str):
    h = lp.submit(rid, PROMPT, GREEDY, prefill_only=True, transfer="push params")
    outs = list(h)
    assert outs[-1].finish_reason == "prefilled"
    return h


def test_a_prefilled_handle_waits_for_its_push(loop):
    lp, conn = loop
    before = lp.initial.free_blocks, lp.initial.free_slots
    h = _prefilled(lp, "p1")
    with pytest.raises(TimeoutError):
        h.wait_transfer(0.2)
    assert _free(lp) != before and lp.stats().result(5).streaming == 1  # held for the push
    _report(lp, conn, SendDone("p1", nbytes=123, seconds=0.5))
    assert h.wait_transfer(5) == SendDone("p1", nbytes=123, seconds=0.5)
    assert _free(lp) == before  # the engine freed the held memory on the record


def test_aborting_a_prefilled_handle_aborts_its_push(loop):
    lp, conn = loop
    h = _prefilled(lp, "p2")
    h.abort()
    assert lp.abort("p2", "the router gave up").result(5).output is None  # by id: the push too
    assert conn.aborted == [("p2", "cancelled by the caller"), ("p2", "the router gave up")]
    _report(lp, conn, SendDone("p2", "cancelled by the caller", aborted=True))
    assert h.wait_transfer(5).aborted
    with pytest.raises(UnknownRequest):
        lp.abort("p2").result(5)


def test_a_reservation_is_awaited_then_admitted(loop):
    lp, conn = loop
    got = lp.reserve("d1", PROMPT, GREEDY, transfer=30.0).result(5)
    assert got.reservation.transfer == "where to write d1"
    ready = lp.await_transfer("d1")
    with pytest.raises(concurrent.futures.TimeoutError):
        ready.result(0.2)
    _report(lp, conn, RecvReady("d1"))
    assert ready.result(5) == RecvReady("d1")
    assert lp.await_transfer("d1").result(5) == RecvReady("d1")  # a late waiter gets it at once
    h = lp.admit("d1", len(PROMPT), 7)
    assert list(h)[-1].finish_reason == "length"
    with pytest.raises(UnknownRequest):
        lp.await_transfer("d1").result(5)


def test_an_idle_loop_polls_a_pending_transfer_less_and_less_often(loop):
    """Nothing to step, a reservation waiting for its state: the polls back off from 1 ms to
    max_poll_interval_s (4 ms), so 0.4 s of waiting costs at most about 100 polls, not 400, and
    the state that lands after it still reaches its waiter at once."""
    lp, conn = loop
    lp.reserve("d3", PROMPT, GREEDY, transfer=30.0).result(5)
    ready = lp.await_transfer("d3")
    start = lp.call(lambda e: conn.polls)
    with pytest.raises(concurrent.futures.TimeoutError):
        ready.result(0.4)
    polls = lp.call(lambda e: conn.polls) - start
    assert 3 <= polls <= 0.4 / lp.max_poll_interval_s + 15, polls
    _report(lp, conn, RecvReady("d3"))
    assert ready.result(0.1 + lp.max_poll_interval_s) == RecvReady("d3")
    assert list(lp.admit("d3", len(PROMPT), 7))[-1].finish_reason == "length"


def _decoded(h, seconds: float) -> int:
    """Tokens a streaming handle delivers within `seconds` (fewer if it finishes first)."""
    n, end = 0, time.monotonic() + seconds
    try:
        while (left := end - time.monotonic()) > 0:
            out = h.next(left)
            n += len(out.new_token_ids)
            if out.finished:
                break
    except TimeoutError:
        pass
    return n


def test_decode_steps_give_way_while_a_prompt_for_this_node_computes(setup):
    """yield_to_prefill_s: a reservation whose state is still to come holds the decode steps back
    (up to the cap after the last one, so they still move), and they go on at once when its state
    is in; without a reservation waiting nothing is held."""
    engine, conn = setup
    lp = EngineLoop(engine, name="yielding", yield_to_prefill_s=0.25).start()
    try:
        free = list(lp.submit("free", PROMPT, GREEDY))  # no reservation: no step held
        assert free[-1].finish_reason == "length" and lp.yielded_s == 0.0
        lp.reserve("d5", PROMPT, GREEDY, transfer=30.0).result(5)
        h = lp.submit("held", PROMPT, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        first = _decoded(h, 1.0)  # the prompt's step, then a step at most every 0.25 s
        assert 1 <= first <= 1 + 1.0 / 0.25 + 1, first
        assert lp.yielded_s > 0.5
        _report(lp, conn, RecvReady("d5"))  # the state is in: nothing to give way to
        assert first + _decoded(h, 10.0) == 64
        assert list(lp.admit("d5", len(PROMPT), 7))[-1].finish_reason == "length"
    finally:
        lp.stop()


def test_a_release_is_answered_once_the_memory_is_back(loop):
    lp, conn = loop
    before = lp.initial.free_blocks, lp.initial.free_slots
    lp.reserve("d2", PROMPT, GREEDY).result(5)
    ready = lp.await_transfer("d2")
    released = lp.release("d2", "the caller went away")
    lp.stats().result(5)  # every command before it has run
    assert conn.aborted == [("d2", "the caller went away")]
    _report(lp, conn, RecvFailed("d2", "the caller went away"))
    assert ready.result(5) == RecvFailed("d2", "the caller went away")
    with pytest.raises(concurrent.futures.TimeoutError):
        released.result(0.2)  # failing, not yet freed
    _report(lp, conn, RecvFreed("d2"))
    assert released.result(5) is None and _free(lp) == before


def test_a_stop_ends_every_transfer_wait(setup):
    engine, conn = setup
    lp = EngineLoop(engine, name="stopping").start()
    h = _prefilled(lp, "p3")
    lp.reserve("d3", PROMPT, GREEDY).result(5)
    ready = lp.await_transfer("d3")
    released = lp.release("p3")
    lp.stop()
    with pytest.raises(ShuttingDown):
        h.wait_transfer(5)
    for fut in (ready, released):
        with pytest.raises(ShuttingDown):
            fut.result(5)
    # the engine still holds them (a transfer might write): what a node's close then tears down
    for rid in ("p3", "d3"):
        conn.live.pop(rid)
        engine.release(rid)
    assert not engine.requests
