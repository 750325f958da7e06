"""The engine loop's typed command API (serving/loop.py, serving/commands.py) over a real engine:
requests stream the tokens transformers generates, errors are typed, memory comes back after
every path, commands after stop are refused, and waits wake on events, not on a poll."""

from __future__ import annotations

import statistics
import threading
import time

import pytest

from engine import SamplingParams
from engine.core import EngineCore
from engine.llm import LLM
from serving.commands import LoopError, NoRoom, Reserved, ShuttingDown, UnknownRequest
from serving.loop import EngineLoop
from tests.helpers import hybrid_ckpt as hc

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(ckpt_hv2):
    # a small cache: 12 blocks of 16 tokens, so a reservation can run out of room
    llm = LLM(ckpt_hv2, dtype="float32", kv_cache_memory=4 * 233472 + 12 * 32768, max_num_seqs=4, max_model_len=512)
    yield llm.engine
    llm.close()


@pytest.fixture
def loop(engine: EngineCore):
    lp = EngineLoop(engine, name="test-engine").start()
    yield lp
    lp.stop()
    assert not engine.requests, "a request outlived its loop"


def _all_free(loop: EngineLoop) -> bool:
    s, i = loop.stats().result(5), loop.initial
    return (s.free_blocks, s.free_slots, s.running, s.waiting, s.reserved) == (
        i.free_blocks,
        i.free_slots,
        0,
        0,
        0,
    )


def test_requests_stream_transformers_tokens(loop, ckpt_hv2):
    prompts = hc.prompts(lens=(5, 23))
    handles = [loop.submit(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for h, p in zip(handles, prompts):
        outs = list(h)
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert sum((o.new_token_ids for o in outs), []) == hc.hf_greedy(ckpt_hv2, p, 8)
        assert h.added is not None and h.added >= h.received
    assert _all_free(loop)


def test_abort_by_id_and_by_handle(loop):
    with pytest.raises(UnknownRequest) as e:
        loop.abort("nobody").result(5)
    assert isinstance(e.value, LookupError) and "nobody" in str(e.value)

    h = loop.submit("long", hc.prompts(lens=(9,))[0], LONG)
    first = h.next(timeout=30)
    assert not first.finished
    got = loop.abort("long").result(5)
    assert got.request_id == "long" and got.output.finish_reason == "abort"
    rest = list(h)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    h.abort()  # a late abort through the handle does nothing, even once the id is reused
    again = loop.submit("long", hc.prompts(lens=(4,))[0], GREEDY)
    h.abort()
    assert list(again)[-1].finish_reason == "length"
    assert _all_free(loop)


def test_bad_request_is_a_value_error_on_its_handle(loop):
    h = loop.submit("empty", [], GREEDY)
    with pytest.raises(ValueError, match="empty prompt"):
        h.next(timeout=5)
    with pytest.raises(ValueError, match="out of range"):
        loop.submit("oov", [10**9], GREEDY).next(timeout=5)
    assert list(loop.submit("fine", [1, 2, 3], GREEDY))[-1].finished  # the loop kept serving


def test_reserve_admit_release(loop, engine):
    prompt = hc.prompts(lens=(20,))[0]
    res = loop.reserve("x", prompt, GREEDY).result(5)
    assert isinstance(res, Reserved) and len(res.reservation.block_ids) == 2  # 21 tokens in blocks of 16
    assert loop.stats().result(5).reserved == 1
    with pytest.raises(UnknownRequest):
        loop.release("not-reserved").result(5)
    loop.release("x").result(5)
    assert _all_free(loop)

    # on_reserved runs on the loop thread; raising gives the memory back
    def boom(r):
        assert threading.current_thread().name == "test-engine"
        raise RuntimeError("adopt failed")

    with pytest.raises(RuntimeError, match="adopt failed"):
        loop.reserve("y", prompt, GREEDY, on_reserved=boom).result(5)
    assert _all_free(loop)

    # admitted with a first token, the request decodes from its (here: empty) reserved state
    seen = []
    loop.reserve("z", prompt, GREEDY, on_reserved=lambda r: r.slot).result(5)
    h = loop.admit("z", len(prompt), 7, prepare=lambda: seen.append(threading.current_thread().name))
    outs = list(h)
    assert seen == ["test-engine"] and outs[0].new_token_ids[0] == 7 and outs[-1].finished
    with pytest.raises(UnknownRequest, match="'z' reserved"):
        loop.admit("z", len(prompt), 7).next(timeout=5)  # over: nothing left to admit
    assert _all_free(loop)


def test_reserve_without_room_is_no_room(loop):
    prompt = hc.prompts(lens=(150,))[0]  # 10 of the 12 blocks
    loop.reserve("a", prompt, GREEDY).result(5)
    with pytest.raises(NoRoom, match="no free KV pages"):
        loop.reserve("b", prompt, GREEDY).result(5)
    loop.release("a").result(5)
    assert _all_free(loop)


def test_commands_after_stop_are_refused(engine):
    lp = EngineLoop(engine, name="stopping").start()
    h = lp.submit("cut", hc.prompts(lens=(9,))[0], LONG)
    h.next(timeout=30)
    lp.stop()
    with pytest.raises(ShuttingDown, match="shutting down"):
        list(h)  # in flight at stop: ended, not left waiting
    for post in (
        lambda: lp.submit("late", [1, 2], GREEDY),
        lambda: lp.abort("cut"),
        lambda: lp.reserve("late", [1, 2], GREEDY),
        lambda: lp.release("late"),
        lambda: lp.stats(),
        lambda: lp.run(lambda e: None),
    ):
        with pytest.raises(ShuttingDown, match="stopped"):
            post()
    h.abort()  # never raises
    assert not engine.requests and issubclass(ShuttingDown, LoopError)

    # a loop stopped before it ran answers what was queued
    idle = EngineLoop(engine, name="never")
    fut, h2 = idle.stats(), idle.submit("q", [1, 2], GREEDY)
    idle.stop()
    with pytest.raises(ShuttingDown):
        fut.result(1)
    with pytest.raises(ShuttingDown):
        h2.next(timeout=1)


def test_an_idle_loop_sleeps_and_wakes_on_a_command(loop):
    """No poll while idle (the loop's pass count stays put), and a command wakes it at once."""
    loop.stats().result(5)
    before = loop.iterations
    time.sleep(0.3)
    assert loop.iterations == before, "the idle loop woke without a command"
    lat = []
    for _ in range(5):
        t0 = time.perf_counter()
        loop.stats().result(5)
        lat.append(time.perf_counter() - t0)
    assert statistics.median(lat) < 0.05, f"wake latencies {lat}"


def test_a_waiting_handle_wakes_on_abort(loop):
    """A handler blocked in next() wakes as soon as another thread aborts its request."""
    h = loop.submit("w", hc.prompts(lens=(9,))[0], LONG)
    h.next(timeout=30)
    woke = {}

    def wait():
        for out in h:
            if out.finished:
                woke["t"] = time.perf_counter()

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    h.abort()
    t.join(5)
    assert "t" in woke and woke["t"] - t0 < 0.05 + 0.1, f"woke {woke.get('t', t0) - t0:.3f} s after the abort"
    assert _all_free(loop)


@pytest.fixture(scope="module")
def cached(ckpt_hv2):
    """An engine with its prefix cache (page hashes and GDN snapshots every 32 tokens)."""
    llm = LLM(ckpt_hv2, dtype="float32", max_num_seqs=4, max_model_len=512, prefix_snapshot_interval=32)
    assert llm.engine.prefix is not None
    yield llm.engine
    llm.close()


def test_a_busy_loop_rebuilds_the_prefix_digest_at_most_every_refresh(cached):
    """take_snapshot: a changed cache rebuilds the digest at once when fresh, else only once
    DIGEST_REFRESH_S passed since the last build; a rebuilt digest names the cache as it is."""
    from dataclasses import replace

    from serving.commands import DIGEST_REFRESH_S, Snapshot, take_snapshot

    pc = cached.prefix
    s0 = take_snapshot(cached, Snapshot())
    assert s0.prefix_digest == pc.digest()
    cached.add_request(hc.prompts(lens=(40,))[0], GREEDY, request_id="digest-r")
    while cached.has_unfinished():
        cached.step()
    assert pc.version() != s0.prefix_digest.version  # its pages are cached now
    recent = replace(s0, prefix_digest_at=time.monotonic())  # built just now (the steps above may take longer)
    stale = take_snapshot(cached, recent, fresh=False)
    assert stale.prefix_digest is s0.prefix_digest and stale.prefix_digest_at == recent.prefix_digest_at
    assert take_snapshot(cached, s0, fresh=True).prefix_digest == pc.digest()
    old = replace(s0, prefix_digest_at=s0.prefix_digest_at - DIGEST_REFRESH_S)
    assert take_snapshot(cached, old, fresh=False).prefix_digest == pc.digest()


def test_an_idle_loop_reports_the_cache_as_it_is(cached):
    """Requests end, the loop goes idle: its last snapshot names the cache that holds them (a busy
    pass's digest may lag; the one before sleeping does not)."""
    lp = EngineLoop(cached, name="test-engine").start()
    try:
        handles = [lp.submit(f"idle{i}", p, GREEDY) for i, p in enumerate(hc.prompts(lens=(37, 52)))]
        for h in handles:
            list(h)
        deadline = time.monotonic() + 5
        while lp.snapshot.running and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # the pass that finished them ends with its snapshot
        got = lp.snapshot.prefix_digest
        assert got is not None and got == lp.call(lambda e: e.prefix.digest())
    finally:
        lp.stop()
