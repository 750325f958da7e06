"""Admission: the router's FIFO queue in front of the pools (docs/ARCHITECTURE.md, "Leases and
admission").

    Generate -> join the queue (refused at once when `max_queued_requests` wait already)
      -> at the head: `place()` under the registry lock, tried again on every change the lock is
         notified of (a heartbeat, a request that ends, a first token back, a client leaving)
      -> placed: leave the queue, the next one is the head     (wait time observed)
      -> `admission_timeout_s` passed: RESOURCE_EXHAUSTED       (nothing was reserved or sent)
      -> the client went away: leave at once (a gRPC callback wakes the queue)

A waiting request holds nothing on any node: decode memory is reserved only once it is placed.
Strict FIFO: a request behind the head waits even when it alone would fit, so a large prompt is
not starved by a stream of small ones.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import grpc

from router.errors import Abort

T = TypeVar("T")


class Admission:
    def __init__(self, cond: threading.Condition, max_queued: int, timeout_s: float, on_leave=None):
        """cond: the registry's condition (every capacity change notifies it). on_leave(outcome,
        wait_s) is called once per request that leaves: "admitted", "queue_full", "timeout",
        "cancelled" (the router's metrics)."""
        self.cond, self.max_queued, self.timeout_s = cond, max_queued, timeout_s
        self._queue: deque[object] = deque()
        self._on_leave = on_leave or (lambda outcome, wait_s: None)

    def depth(self) -> int:
        return len(self._queue)

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def wait(self, place: Callable[[], T | None], context, refuse: Callable[[], Abort]) -> T:
        """Wait in FIFO order until `place()` (called under the lock, only at the head) returns a
        placement. `refuse()` makes the error of a request that timed out (RESOURCE_EXHAUSTED, or
        UNAVAILABLE when no node takes requests at all)."""
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        me = object()
        context.add_callback(self.wake)  # a client that goes away leaves the queue at once
        with self.cond:
            if self.max_queued and len(self._queue) >= self.max_queued:
                self._on_leave("queue_full", 0.0)
                raise Abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{len(self._queue)} requests already wait for admission (the limit): try again later",
                )
            self._queue.append(me)
            outcome = "timeout"
            try:
                while True:
                    if not context.is_active():
                        outcome = "cancelled"
                        raise Abort(grpc.StatusCode.CANCELLED, "the client went away while waiting for admission")
                    if self._queue[0] is me:
                        got = place()
                        if got is not None:
                            outcome = "admitted"
                            return got
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise refuse()
                    self.cond.wait(min(left, 1.0))
            finally:
                self._queue.remove(me)
                self.cond.notify_all()  # the next one may be the head now
                self._on_leave(outcome, time.monotonic() - t0)
