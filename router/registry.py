"""The router's node registry: registered and static nodes, liveness from heartbeats, incarnations,
draining nodes alive but not routable, the router's own in-flight discount between heartbeats,
and each node's prefix cache view; every change wakes the admission queue."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from proto import pb, rpc
from router.net import node_channel
from router.prefix import NodeCache
from router.token_mux import MuxTotals, TokenMux
from serving.security import OPEN, Credentials

CREDIT_MAX_S = 10.0  # an end no report has counted by then is dropped (a node that stopped reporting)
FORGET_AFTER_S = 600.0  # a node dead this long leaves the registry (`pdserve nodes`); back, it registers again

log = logging.getLogger("pdserve.router")

# each node kind's service (all of them answer Stats)
STUBS: dict[int, type] = {
    pb.NODE_KIND_DECODE: rpc.DecodeNodeStub,
    pb.NODE_KIND_PREFILL: rpc.PrefillNodeStub,
    pb.NODE_KIND_ENCODE: rpc.EncodeNodeStub,
}


@dataclass
class NodeEntry:
    info: pb.NodeInfo
    static: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    unreachable: bool = False  # a call found it gone (UNAVAILABLE): no new requests until it reports
    inflight: int = 0  # requests the router has on this node now
    inflight_blocks: int = 0  # KV blocks those requests' prompts need
    # prompt tokens sent to this prefill node (to a decode node: those it computes itself, its
    # cached prefix left out), first token not back
    inflight_prefill_tokens: int = 0
    inflight_interactive_tokens: int = 0  # ... of them, interactive ones (the node schedules them first)
    # ... the sum of each prompt's tokens squared (all, interactive): with the tokens, their
    # length-weighted mean length, which prices them exactly under the node's fitted cost
    # (router/wait_estimate.py)
    inflight_prefill_squares: int = 0
    inflight_interactive_squares: int = 0
    # ended by the router's view, not yet in the node's reports (free on the node), one per end:
    # (the node's count of ended requests with it, 0 unknown; slots; blocks; when), kept until a
    # report counts that end (requests_ended), not merely until the next report, which the node
    # may have built before the end
    credits: list[tuple[int, int, int, float]] = field(default_factory=list)
    prefilled_tokens: int = 0  # prompt tokens whose first token came back (no longer queued there)
    reported_inflight: int = 0  # inflight_prefill_tokens when the last report came: counted in it
    chan: grpc.aio.Channel | None = None
    _stub: object = None
    creds: Credentials = OPEN  # how the router dials the node (the cluster token, TLS)
    cache: NodeCache = field(default_factory=NodeCache)  # its prefix cache (router/prefix.py)
    mux_totals: MuxTotals | None = None  # the registry's, shared by every node's token stream
    _mux: TokenMux | None = None

    def __post_init__(self):
        if self.info.HasField("prefix"):  # kept parsed only (ListNodes stays small)
            self.cache.update(self.info.prefix)
            self.info.ClearField("prefix")

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def kind(self) -> int:
        return self.info.kind

    @property
    def stub(self):
        """The node's aio stub, made on first use (on the event loop, where every call runs)."""
        if self._stub is None:
            self.chan = node_channel(self.info.address, self.creds)
            self._stub = STUBS.get(self.info.kind, rpc.PrefillNodeStub)(self.chan)
        return self._stub

    @property
    def mux(self) -> TokenMux:
        """The node's token stream for this router (router/token_mux.py), opened on first use."""
        if self._mux is None:
            self._mux = TokenMux(self.node_id, lambda: self.stub, self.mux_totals)
        return self._mux

    def close(self, loop: asyncio.AbstractEventLoop | None) -> None:
        mux, self._mux = self._mux, None
        if mux is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(mux.close)
        chan, self.chan, self._stub = self.chan, None, None
        if chan is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(lambda: loop.create_task(chan.close()))

    # capacity as the router estimates it now
    def est_free_slots(self) -> int:
        c = self.info.capacity
        return min(c.free_slots + self.freed_slots, c.total_slots - self.inflight)

    def est_free_blocks(self) -> int:
        c = self.info.capacity
        return min(c.free_blocks + self.freed_blocks, c.total_blocks - self.inflight_blocks)

    def est_running(self) -> int:
        """Requests running on the node: its last report less those the router saw end since (a
        heartbeat can lag a request's end), at least the router's own in flight there."""
        return max(self.info.capacity.running - self.freed_slots, self.inflight)

    @property
    def freed_slots(self) -> int:
        return sum(c[1] for c in self.credits)

    @property
    def freed_blocks(self) -> int:
        return sum(c[2] for c in self.credits)

    def credit(self, slots: int, blocks: int, seq: int) -> None:
        """A request on this node ended (registry lock held); `seq`: its node_ended, 0 unknown."""
        self.credits.append((seq, slots, blocks, time.monotonic()))

    def reported(self) -> None:
        """A fresh capacity report arrived: it includes the ends it counts (and those of unknown
        order), not those after it."""
        self.last_seen = now = time.monotonic()
        ended = self.info.requests_ended
        self.credits = [c for c in self.credits if c[0] > ended and now - c[3] < CREDIT_MAX_S]
        self.prefilled_tokens = 0
        self.reported_inflight = self.inflight_prefill_tokens
        self.unreachable = False

    def prefill_sent(self, tokens: int, interactive: bool = False) -> None:
        """The router sent the node `tokens` prompt tokens to compute (registry lock held)."""
        self.inflight_prefill_tokens += tokens
        self.inflight_interactive_tokens += tokens if interactive else 0
        self.inflight_prefill_squares += tokens**2
        self.inflight_interactive_squares += tokens**2 if interactive else 0

    def prefill_back(self, tokens: int, interactive: bool = False) -> None:
        """What `prefill_sent` counted is no longer queued there, computed or given up (registry
        lock held), though the node's last report may still count it."""
        self.inflight_prefill_tokens -= tokens
        self.inflight_interactive_tokens -= tokens if interactive else 0
        self.inflight_prefill_squares = max(0, self.inflight_prefill_squares - tokens**2)
        if interactive:
            self.inflight_interactive_squares = max(0, self.inflight_interactive_squares - tokens**2)
        self.prefilled_tokens += tokens

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens waiting on the node: its last report, less what it prefilled for the
        router since, plus what the router sent it since. What the router had in flight there when
        the report came is in the report: counted once (the first to come back are taken to be
        those), not again as in flight."""
        c = self.info.capacity
        in_report = max(0, self.reported_inflight - self.prefilled_tokens)
        since = max(0, self.inflight_prefill_tokens - in_report)
        return max(0, c.queued_prefill_tokens - self.prefilled_tokens) + since

    def blocks_for(self, num_tokens: int) -> int:
        bs = self.info.capacity.block_size or 1
        return -(-num_tokens // bs)

    def outstanding(self, batch: bool) -> int:
        """Prompt tokens this router has outstanding on this prefill node that a new prompt of its
        class (batch or interactive) queues behind."""
        return self.inflight_prefill_tokens if batch else self.inflight_interactive_tokens

    def holds(self, prompt_len: int) -> bool:
        """Whether this node's cache can ever hold a prompt of `prompt_len` tokens (its pages for
        prompt_len + 1, as the engine counts them): a prefill node that cannot refuses it
        (INVALID_ARGUMENT), while the decode node, sized on its own, may well compute it
        (router/prefill.py). True for 0 tokens and before the node reports its capacity."""
        total = self.info.capacity.total_blocks
        return not prompt_len or not total or self.blocks_for(prompt_len + 1) <= total


class NodeRegistry:
    def __init__(self, heartbeat_interval_s: float = 0.5, dead_after_s: float = 3.0, creds: Credentials = OPEN):
        self.creds = creds
        self.heartbeat_interval_s = heartbeat_interval_s
        self.dead_after_s = dead_after_s
        # a node dead this long is forgotten (a pool scaled down): it registers again if it comes back
        self.forget_after_s = FORGET_AFTER_S
        self.nodes: dict[str, NodeEntry] = {}
        self.static_addrs: dict[str, int] = {}  # address -> expected kind
        self.lock = threading.RLock()
        self.on_change: Callable[[], None] = lambda: None  # set by the router: wake the admission queue
        self.loop: asyncio.AbstractEventLoop | None = None  # the router's loop (node channels close there)
        self.mux_totals = MuxTotals()  # every node's token stream (router/token_mux.py)

    # ---- registration ---------------------------------------------------------------------
    def taken(self, info: pb.NodeInfo) -> NodeEntry | None:
        """The live node that already has info's node_id, when info is another process: another
        incarnation at another address, the holder heard from within dead_after_s (a node that
        restarts takes its id back at once at its old address, or once the old one is dead)."""
        with self.lock:
            old = self.nodes.get(info.node_id)
            if old is None or old.info.incarnation == info.incarnation or old.info.address == info.address:
                return None
            return old if old.alive and time.monotonic() - old.last_seen <= self.dead_after_s else None

    def register(self, info: pb.NodeInfo, static: bool = False) -> NodeEntry:
        with self.lock:
            old = self.nodes.get(info.node_id)
            if old is not None and old.info.incarnation == info.incarnation and old.info.address == info.address:
                old.info = info
                if info.HasField("prefix"):
                    old.cache.update(info.prefix)
                    info.ClearField("prefix")
                old.reported()
                if not old.alive:
                    log.info("node %s (%s) is back", info.node_id, info.address)
                old.alive = True
                self.on_change()
                return old
            e = NodeEntry(
                info=info,
                static=static or (old is not None and old.static),
                creds=self.creds,
                mux_totals=self.mux_totals,
            )
            if old is not None:
                old.close(self.loop)
                log.info(
                    "node %s re-registered (incarnation %x -> %x)", info.node_id, old.info.incarnation, info.incarnation
                )
            else:
                log.info(
                    "node %s registered: %s at %s, tp=%d",
                    info.node_id,
                    pb.NodeKind.Name(info.kind),
                    info.address,
                    info.tp_size,
                )
            self.nodes[info.node_id] = e
            self.on_change()
            return e

    def heartbeat(
        self,
        node_id: str,
        incarnation: int,
        capacity: pb.Capacity,
        draining: bool = False,
        prefix: pb.PrefixDigest | None = None,
        prefill_tokens_per_s: float = 0.0,
        requests_ended: int = 0,
        prefill_cost: pb.PrefillCost | None = None,
    ) -> bool:
        """prefix: the node's prefix digest when it changed since its last report (else None)."""
        with self.lock:
            e = self.nodes.get(node_id)
            if e is None or e.info.incarnation != incarnation:
                return False
            e.info.capacity.CopyFrom(capacity)
            e.info.requests_ended = requests_ended
            e.info.prefill_tokens_per_s = prefill_tokens_per_s
            if prefill_cost is not None:
                e.info.prefill_cost.CopyFrom(prefill_cost)
            if prefix is not None:
                e.cache.update(prefix)
            if draining and not e.info.draining:
                log.info("node %s is draining: no new requests go there", node_id)
            e.info.draining = draining
            e.reported()
            if not e.alive:
                log.info("node %s is back", node_id)
            e.alive = True
            self.on_change()
            return True

    def add_static(self, address: str, kind: int) -> None:
        self.static_addrs[address] = kind

    # ---- health -------------------------------------------------------------------------------
    async def sweep(self) -> list[NodeEntry]:
        """Mark nodes without a recent heartbeat dead; poll static nodes that are not heartbeating.
        Returns the nodes it marked dead."""
        now = time.monotonic()
        dead: list[NodeEntry] = []
        with self.lock:
            for e in self.nodes.values():
                if e.alive and now - e.last_seen > self.dead_after_s:
                    e.alive = False
                    dead.append(e)
                    # a draining node that goes quiet has stopped, as its drain ends: no fault
                    log.log(
                        logging.INFO if e.info.draining else logging.WARNING,
                        "node %s (%s): no heartbeat for %.1f s, marked dead%s",
                        e.node_id,
                        e.info.address,
                        now - e.last_seen,
                        " (it was draining: stopped)" if e.info.draining else "",
                    )
            gone = [
                e
                for e in self.nodes.values()
                if not e.alive and not e.static and now - e.last_seen > self.forget_after_s
            ]
            for e in gone:
                del self.nodes[e.node_id]
                e.close(self.loop)
                log.info("node %s (%s): dead for %.0f s, forgotten", e.node_id, e.info.address, now - e.last_seen)
            fresh = {e.info.address for e in self.nodes.values() if now - e.last_seen < self.heartbeat_interval_s}
        for addr, kind in list(self.static_addrs.items()):
            if addr in fresh:
                continue
            async with node_channel(addr, self.creds) as ch:
                stub = STUBS.get(kind, rpc.PrefillNodeStub)(ch)
                try:
                    info = await stub.Stats(pb.StatsRequest(), timeout=1.0)
                except grpc.RpcError:
                    continue
            self.register(info, static=True)
        return dead

    def snapshot(self) -> list[tuple[NodeEntry, float]]:
        now = time.monotonic()
        with self.lock:
            return [(e, now - e.last_seen) for e in self.nodes.values()]

    def live(self, kind: int) -> list[NodeEntry]:
        with self.lock:  # re-entrant: callers may already hold it
            return [e for e in self.nodes.values() if e.alive and e.kind == kind]

    def routable(self, kind: int) -> list[NodeEntry]:
        """Live, reachable and not draining: nodes that may get new requests."""
        with self.lock:
            return [
                e
                for e in self.nodes.values()
                if e.alive and not e.unreachable and not e.info.draining and e.kind == kind
            ]

    def mark_unreachable(self, e: NodeEntry, why: str) -> None:
        """A call to the node failed UNAVAILABLE (its process gone, say): no new requests go there
        until its next report, without waiting for the heartbeats to declare it dead (its streams
        in flight are left to their own calls)."""
        with self.lock:
            if not e.unreachable:
                log.warning("node %s unreachable (%s): no new requests until it reports again", e.node_id, why)
            e.unreachable = True

    def mark_draining(self, e: NodeEntry) -> None:
        """The node refused a call because it drains (until a heartbeat says otherwise)."""
        with self.lock:
            if not e.info.draining:
                log.info("node %s is draining: no new requests go there", e.node_id)
            e.info.draining = True

    async def close(self) -> None:
        with self.lock:
            chans = [e.chan for e in self.nodes.values() if e.chan is not None]
            for e in self.nodes.values():
                if e._mux is not None:
                    e._mux.close()
                e.chan = e._stub = e._mux = None
        for ch in chans:
            await ch.close()
