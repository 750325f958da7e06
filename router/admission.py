"""Admission: the router's strict FIFO queue in front of the pools, on its event loop. Only the head
is woken to try `place()`; a request that waits too long or finds the queue full is refused with
RESOURCE_EXHAUSTED, holding nothing on any node (docs/router.md, "Leases and admission")."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import grpc

from router.errors import Abort

T = TypeVar("T")


class Admission:
    def __init__(self, max_queued: int, timeout_s: float, on_leave=None):
        """on_leave(outcome, wait_s) is called once per request that leaves: "admitted",
        "queue_full", "timeout", "cancelled" (the router's metrics)."""
        self.max_queued, self.timeout_s = max_queued, timeout_s
        self._queue: deque[asyncio.Event] = deque()
        self._on_leave = on_leave or (lambda outcome, wait_s: None)

    def depth(self) -> int:
        return len(self._queue)

    def wake(self) -> None:
        """Something changed: the head tries to place itself again (on the loop's thread)."""
        if self._queue:
            self._queue[0].set()

    async def wait(self, place: Callable[[], T | None], refuse: Callable[[], Abort]) -> T:
        """Wait in FIFO order until `place()` (called only at the head) returns a placement.
        `refuse()` makes the error of a request that timed out (RESOURCE_EXHAUSTED, or
        UNAVAILABLE when no node takes requests at all)."""
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        if self.max_queued and len(self._queue) >= self.max_queued:
            self._on_leave("queue_full", 0.0)
            raise Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self._queue)} requests already wait for admission (the limit): try again later",
            )
        me = asyncio.Event()
        self._queue.append(me)
        outcome = "timeout"
        try:
            while True:
                if self._queue[0] is me:
                    got = place()
                    if got is not None:
                        outcome = "admitted"
                        return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise refuse()
                me.clear()
                try:
                    await asyncio.wait_for(me.wait(), left)
                except TimeoutError:
                    pass
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self._queue.remove(me)
            self.wake()  # the next one may be the head now
            self._on_leave(outcome, time.monotonic() - t0)
