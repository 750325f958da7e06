"""Mid-stream migration (docs/router.md, "Migration"): when the decode node of a request that has
streamed tokens fails (UNAVAILABLE, declared dead by the heartbeats, a drain that ends the
stream, or the node giving up the memory of an image request it has no pixels to recompute), the
request is placed again on a decode node (another one, but for memory given up) with the tokens
already sent as its output so far (DecodeRequest.resume_token_ids). This module owns the decision (which failures
move, the --max-migrations bound), the watcher that turns heartbeat loss into a failure, and the
migration metrics; `watched` gives a prefill node's calls the same heartbeat watch."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from router.errors import Abort
from serving.rpc import gave_memory_up, is_draining

if TYPE_CHECKING:
    from router.registry import NodeEntry

CAUSES = ("unavailable", "node_dead", "draining", "memory")
T = TypeVar("T")


class Moved(Exception):
    """Place the request again on another decode node (or the same one, when the node that failed
    was the prefill node pushing to it), resuming from the tokens sent."""

    def __init__(self, cause: str, node_id: str) -> None:
        super().__init__(f"{cause} on {node_id}")
        self.cause, self.node_id = cause, node_id


def cause_of(e: grpc.RpcError, node_lost: bool) -> str | None:
    """Why a decode stream that failed may move ("unavailable" | "node_dead" | "draining" | "memory":
    the node gave the memory of an image request it cannot recompute up), or None:
    the failure is the request's own (bad input, an internal error) and moving would not help."""
    if node_lost:
        return "node_dead"
    if gave_memory_up(e):
        return "memory"
    if is_draining(e):
        return "draining"
    if e.code() == grpc.StatusCode.UNAVAILABLE:
        return "unavailable"
    return None


class NodeLost(grpc.RpcError):
    """A node call the router cancelled because the heartbeats declared its node dead."""

    def __init__(self, node_id: str, what: str = "was declared dead (no heartbeat)", kind: str = "decode") -> None:
        super().__init__(f"{kind} node {node_id} {what}")
        self.node_id = node_id

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return str(self)

    def trailing_metadata(self) -> tuple[()]:
        return ()


class Tried:
    """The decode nodes a request was placed on, each at the incarnation it had then: admission
    places the request on none of them again, unless that node restarted since (a new incarnation
    under the same id, as a StatefulSet's pod comes back), which holds nothing of the request."""

    def __init__(self) -> None:
        self._at: dict[str, int] = {}

    def add(self, e: NodeEntry) -> None:
        self._at[e.node_id] = e.info.incarnation

    def discard(self, node_id: str) -> None:
        self._at.pop(node_id, None)

    def __contains__(self, e: NodeEntry) -> bool:
        return self._at.get(e.node_id) == e.info.incarnation

    def __len__(self) -> int:
        return len(self._at)


class MigrationMetrics:
    """pdserve_router_migrations_total{cause} and the gap a migration adds to a stream."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.moves = Counter(
            "pdserve_router_migrations",
            "In-flight requests moved to another decode node after their node failed mid-stream",
            ["cause"],
            registry=registry,
        )
        self.refused = Counter(
            "pdserve_router_migrations_refused",
            "Requests whose decode node failed mid-stream and that could not move (--max-migrations reached)",
            registry=registry,
        )
        self.gap = Histogram(
            "pdserve_router_migration_gap_seconds",
            "Time from a decode node's failure to the moved request's next token",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=registry,
        )
        for c in CAUSES:
            self.moves.labels(cause=c)


class Migration:
    """One request's moves: how many so far, and the gap of the latest until its next token."""

    def __init__(self, limit: int, metrics: MigrationMetrics) -> None:
        self.limit, self.metrics = limit, metrics
        self.count = 0
        self.path: list[str] = []  # "node(cause@tokens)" per move, for the log line
        self._failed_at: float | None = None

    def move(self, e: grpc.RpcError, node_id: str, sent: int, node_lost: bool) -> None:
        """Raise Moved when this failure, after `sent` tokens, moves the request; Abort when it
        would but the limit is reached; return when the failure is not a node's."""
        cause = cause_of(e, node_lost)
        if cause is None:
            return
        if self.count >= self.limit:
            self.metrics.refused.inc()
            code = e.code() if not node_lost else grpc.StatusCode.UNAVAILABLE
            raise Abort(
                code,
                f"node {node_id} failed after {sent} tokens ({cause}: {e.details() or e.code().name}); "
                f"the request already moved {self.count} time(s), the limit (--max-migrations {self.limit})",
            )
        self.count += 1
        self.path.append(f"{node_id}({cause}@{sent})")
        self.metrics.moves.labels(cause=cause).inc()
        self._failed_at = time.monotonic()
        raise Moved(cause, node_id)

    def resumed(self) -> None:
        """The moved request's next token arrived: record the gap once."""
        if self._failed_at is not None:
            self.metrics.gap.observe(time.monotonic() - self._failed_at)
            self._failed_at = None


class NodeWatch:
    """Cancel a decode call once its node is declared dead by the heartbeats (a hung node's stream
    would otherwise stall forever); `lost` tells the caller why its call was cancelled."""

    def __init__(self, alive: Callable[[], bool], cancel: Callable[[], object], interval_s: float) -> None:
        self.lost = False
        self._alive, self._cancel, self._interval = alive, cancel, interval_s
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while self._alive():
            await asyncio.sleep(self._interval)
        self.lost = True
        self._cancel()

    def stop(self) -> None:
        self._task.cancel()


async def watched(
    node: NodeEntry, read: Callable[[], Awaitable[T]], cancel: Callable[[], object], interval_s: float
) -> T:
    """`await read()` (a prefill node's next message) unless the heartbeats declare `node` dead
    first: then `cancel()` and NodeLost (UNAVAILABLE), the failure of a node that died, where a
    hung node's call would wait out its deadline (--prefill-timeout and more)."""
    watch = NodeWatch(lambda: node.alive, cancel, interval_s)
    try:
        return await read()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not watch.lost or (task is not None and task.cancelling()):
            raise
        raise NodeLost(node.node_id, kind="prefill") from None
    finally:
        watch.stop()
