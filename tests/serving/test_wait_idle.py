"""serving/rpc.py `wait_idle`, the wait of a node's drain: it reads the in-flight count only
when the code that changes it signals (`Changes`) or the drain is interrupted (`Interrupt`, from
a thread or a signal handler), so it returns within milliseconds of the count reaching 0, at the
timeout otherwise, and reads nothing in between (no polling loop)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from serving.rpc import Changes, Interrupt, wait_idle

pytestmark = pytest.mark.serial  # bounds of tens of milliseconds: run alone, not beside another test worker

PROMPT_S = 0.05  # how soon after the count drops (or the interrupt) the wait must return


class Counter:
    """An in-flight count and how often the wait read it."""

    def __init__(self, n: int):
        self.n, self.reads = n, 0

    def __call__(self) -> int:
        self.reads += 1
        return self.n


def _later(delay_s: float, fn) -> dict:
    """Run fn on a thread after delay_s; the dict gets the monotonic time it ran at."""
    out: dict = {}

    def run():
        time.sleep(delay_s)
        out["t"] = time.monotonic()
        fn()

    threading.Thread(target=run, daemon=True).start()
    return out


def test_returns_when_the_count_drops_to_zero():
    count, changes = Counter(3), Changes()

    def drop():
        count.n = 0
        changes.changed()

    at = _later(0.3, drop)
    ok = wait_idle("test", count, changes, timeout_s=10)
    done = time.monotonic()
    assert ok
    assert done - at["t"] < PROMPT_S, f"returned {1e3 * (done - at['t']):.1f} ms after the count dropped"
    # one read at the start, one after the signal: a 50 ms poll would have read ~7 times
    assert count.reads == 2


def test_each_change_is_one_read_and_only_zero_ends_it():
    count, changes = Counter(3), Changes()

    def steps():
        for n in (2, 1, 0):
            time.sleep(0.1)
            count.n = n
            changes.changed()

    t0 = time.monotonic()  # before the thread: its sleeps may begin before this line runs
    threading.Thread(target=steps, daemon=True).start()
    assert wait_idle("test", count, changes, timeout_s=10)
    assert 0.3 <= time.monotonic() - t0 < 0.3 + 0.2
    assert count.reads == 4


def test_times_out_without_reading_in_between():
    count, changes = Counter(1), Changes()
    t0 = time.monotonic()
    assert not wait_idle("test", count, changes, timeout_s=0.3)
    took = time.monotonic() - t0
    assert 0.3 <= took < 0.3 + PROMPT_S, took
    assert count.reads == 2  # at the start and at the timeout, nothing between (a 50 ms poll: 7)
    assert not changes._waiters  # the wait unhooked itself
    changes.changed()  # with nobody waiting: nothing queued, nothing happens


def test_interrupt_from_a_thread_ends_the_wait_at_once():
    count, changes, now = Counter(1), Changes(), Interrupt()
    at = _later(0.2, now.set)
    assert not wait_idle("test", count, changes, timeout_s=10, interrupt=now)
    assert time.monotonic() - at["t"] < PROMPT_S
    assert not now._waiters


def test_interrupt_from_a_signal_handler_ends_the_wait_at_once():
    """What `pdserve decode` / `prefill` do on a second SIGTERM: the handler, on the main thread,
    sets the Interrupt while that same thread waits."""
    count, changes, now = Counter(1), Changes(), Interrupt()
    old = signal.signal(signal.SIGUSR1, lambda *_: now.set())
    try:
        at = _later(0.2, lambda: os.kill(os.getpid(), signal.SIGUSR1))
        assert not wait_idle("test", count, changes, timeout_s=10, interrupt=now)
        assert time.monotonic() - at["t"] < PROMPT_S
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_already_idle_or_interrupted_returns_at_once():
    now = Interrupt()
    now.set()
    t0 = time.monotonic()
    assert wait_idle("test", Counter(0), Changes(), timeout_s=10)
    assert not wait_idle("test", Counter(2), Changes(), timeout_s=10, interrupt=now)
    assert time.monotonic() - t0 < PROMPT_S


def test_a_plain_event_is_refused():
    with pytest.raises(TypeError, match="Interrupt"):
        wait_idle("test", Counter(1), Changes(), timeout_s=1, interrupt=threading.Event())
