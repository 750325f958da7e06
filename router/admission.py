"""Admission: the router's queue in front of the pools, on its event loop. A request is decided at
arrival: refused at once (RESOURCE_EXHAUSTED, with the estimated wait) when the router estimates
it could not start within its budget, else queued until `place()` succeeds, however long that
takes. Priority classes go in order; within a class, API keys take turns (docs/router.md,
"Leases and admission"). One exception to the order: while the head waits for decode room, a
request that needs none (it ends at its first token) may be placed from behind it."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from router.errors import Abort

T = TypeVar("T")

INTERACTIVE, BATCH = 0, 1
QUEUE_FULL_RETRY_S = 1.0  # a full queue's Retry-After where the estimate says less (or nothing)
CLASS_NAMES = ("interactive", "batch")


@dataclass(frozen=True)
class Ask:
    """What one request asks of admission."""

    priority: int = INTERACTIVE
    tenant: str = ""  # the API key's id ("" without keys): turns within a class
    budget_s: float = 0.0  # the longest it may wait to start; 0: as long as it takes
    tokens: int = 0  # prompt tokens it brings to the prefill pool (0: prefilled on the decode node)
    resumed: bool = False  # admitted before (failover): never refused for lack of budget
    alone: bool = False  # ends at its first token: needs a prefill node's window only, no decode room

    @property
    def class_name(self) -> str:
        return CLASS_NAMES[self.priority]


class Refused(Abort):
    """RESOURCE_EXHAUSTED at arrival; `retry_after_s` is the estimated wait."""

    def __init__(self, msg: str, retry_after_s: float):
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, msg)
        self.retry_after_s = retry_after_s


class _Waiter:
    __slots__ = ("ask", "event")

    def __init__(self, ask: Ask):
        self.ask, self.event = ask, asyncio.Event()


class Admission:
    def __init__(self, max_queued: int, on_leave: Callable[[str, Ask, float], None] | None = None):
        """on_leave(outcome, ask, wait_s) is called once per request that leaves: "admitted",
        "queue_full", "estimate", "unavailable", "cancelled" (the router's metrics)."""
        self.max_queued = max_queued
        # per class, tenant -> its waiters in arrival order; the dict's order is the turn order
        self._classes: list[dict[str, deque[_Waiter]]] = [{} for _ in CLASS_NAMES]
        self._tokens = [0] * len(CLASS_NAMES)
        self._squares = [0] * len(CLASS_NAMES)  # the sum of each one's tokens squared (wait_estimate)
        self._count = [0] * len(CLASS_NAMES)
        self._on_leave = on_leave or (lambda outcome, ask, wait_s: None)
        # the head's last try found no decode room: requests needing none may go first
        self._decode_bound = False
        self._lacked: bool | None = None  # what the try under way lacked (`blocked`)
        self._alone: set[_Waiter] = set()

    def depth(self, priority: int | None = None) -> int:
        return sum(self._count) if priority is None else self._count[priority]

    def ahead(self, priority: int) -> tuple[int, int, int]:
        """(prefill-pool tokens, requests, the sum of each request's tokens squared) queued in this
        class and the ones before it: the squares price prompts of mixed lengths (wait_estimate)."""
        k = priority + 1
        return sum(self._tokens[:k]), sum(self._count[:k]), sum(self._squares[:k])

    def _head(self) -> _Waiter | None:
        for tenants in self._classes:
            for q in tenants.values():
                return q[0]
        return None

    def wake(self) -> None:
        """Something changed: the head tries to place itself again (on the loop's thread), and
        while the head waits for decode room, so do the requests that need none."""
        h = self._head()
        if h is not None:
            h.event.set()
        if self._decode_bound:
            for w in self._alone:
                w.event.set()

    def blocked(self, on_decode: bool) -> None:
        """Called by `place()` when it fails: for lack of decode room (True) or of a prefill
        node's window (False)."""
        self._lacked = on_decode

    def decide(self, ask: Ask, estimate_s: float, what: str) -> None:
        """Refuse at arrival (Refused) when the queue is full (to retry after the estimated wait)
        or the estimated wait passes the budget; `what` says what the estimate is made of."""
        if ask.resumed:
            return
        # the limit counts the requests that start before it: its class and the ones before it (an
        # interactive request was refused while a batch flood filled the queue, though it would
        # have started ahead of all of it); the queue then holds at most the limit once per class
        ahead = self.ahead(ask.priority)[1]
        if self.max_queued and ahead >= self.max_queued:
            self._on_leave("queue_full", ask, 0.0)
            # come back when the queue ahead would have let it start, not in a second: a full queue
            # takes the pools that long to drain, and clients told 1 s retry it dozens of times
            after = estimate_s if math.isfinite(estimate_s) and estimate_s > QUEUE_FULL_RETRY_S else QUEUE_FULL_RETRY_S
            when = f" in about {after:.0f} s" if after > QUEUE_FULL_RETRY_S else " later"
            raise Refused(
                f"{ahead} requests that start before this {ask.class_name} one already wait for admission (the "
                f"limit): try again{when}",
                after,
            )
        if not ask.budget_s or estimate_s <= ask.budget_s:
            return
        self._on_leave("estimate", ask, 0.0)
        est = "an unknown time" if math.isinf(estimate_s) else f"about {estimate_s:.1f} s"
        raise Refused(
            f"this {ask.class_name} request would start in {est} ({what}), past its admission budget of "
            f"{ask.budget_s:g} s: try again later, or send a longer budget",
            estimate_s if math.isfinite(estimate_s) else ask.budget_s,
        )

    async def wait(self, ask: Ask, place: Callable[[], T | None], unavailable: Callable[[], Abort | None]) -> T:
        """Wait in turn until `place()` (called only at the head) returns a placement. No late
        refusal: past the budget, only `unavailable()` (no node takes requests at all) ends the wait."""
        t0 = time.monotonic()
        deadline = t0 + ask.budget_s if ask.budget_s else math.inf
        me = _Waiter(ask)
        p = ask.priority
        self._classes[p].setdefault(ask.tenant, deque()).append(me)
        if ask.alone:
            self._alone.add(me)
        self._tokens[p] += ask.tokens
        self._squares[p] += ask.tokens**2
        self._count[p] += 1
        outcome = "cancelled"
        try:
            while True:
                head = self._head() is me
                if head or (ask.alone and self._decode_bound):
                    self._lacked = None
                    got = place()
                    if head:  # only the head's own try says what the queue waits for
                        was, self._decode_bound = self._decode_bound, got is None and self._lacked is True
                        if self._decode_bound and not was:
                            self.wake()
                    if got is not None:
                        outcome = "admitted"
                        return got
                if time.monotonic() >= deadline:
                    err = unavailable()
                    if err is not None:
                        outcome = "unavailable"
                        raise err
                    deadline = math.inf
                me.event.clear()
                left = deadline - time.monotonic()
                try:
                    await asyncio.wait_for(me.event.wait(), None if math.isinf(left) else max(left, 0.0))
                except TimeoutError:
                    pass
        finally:
            self._alone.discard(me)
            tenants = self._classes[p]
            q = tenants[ask.tenant]
            q.remove(me)
            if not q:
                del tenants[ask.tenant]
            elif outcome == "admitted":  # placed: the tenant's turn passes to the next one
                tenants[ask.tenant] = tenants.pop(ask.tenant)
            self._tokens[p] -= ask.tokens
            self._squares[p] -= ask.tokens**2
            self._count[p] -= 1
            self.wake()  # the next one may be the head now
            self._on_leave(outcome, ask, time.monotonic() - t0)
