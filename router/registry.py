"""The router's node registry: who is up, what they can take, and what the router sent them.

Nodes arrive two ways: dynamic registration (Registry.Register, then heartbeats), or static
addresses from the command line / pools file, which the router polls with Stats. A node whose
last heartbeat (or successful poll) is older than `dead_after_s` is marked dead and gets no new
requests; a heartbeat from an unknown node id or an older incarnation is answered
`known=False`, which makes the node register again (a restart is a new incarnation).
A draining node (heartbeat `draining`, or a call it refused with `pdserve-draining`) is alive
but `routable` no more: it finishes what it holds and gets nothing new.

Between heartbeats the router discounts what it has itself sent to a node (`inflight`,
`inflight_blocks`), so a burst of requests does not all land on the node that looked emptiest.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import grpc

from proto import pb, rpc
from proto.serving import channel

log = logging.getLogger("pdserve.router")


@dataclass
class NodeEntry:
    info: pb.NodeInfo
    static: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    inflight: int = 0  # requests the router has on this node now
    inflight_blocks: int = 0  # KV blocks those requests' prompts need
    inflight_prefill_tokens: int = 0
    # finished by the router since the node's last report: free on the node, not yet reported
    freed_slots: int = 0
    freed_blocks: int = 0
    chan: grpc.Channel | None = None
    stub: object = None

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def kind(self) -> int:
        return self.info.kind

    def connect(self) -> None:
        self.chan = channel(self.info.address)
        if self.info.kind == pb.NODE_KIND_DECODE:
            self.stub = rpc.DecodeNodeStub(self.chan)
        else:
            self.stub = rpc.PrefillNodeStub(self.chan)

    def close(self) -> None:
        if self.chan is not None:
            self.chan.close()
            self.chan = None

    # capacity as the router estimates it now
    def est_free_slots(self) -> int:
        c = self.info.capacity
        return min(c.free_slots + self.freed_slots, c.total_slots - self.inflight)

    def est_free_blocks(self) -> int:
        c = self.info.capacity
        return min(c.free_blocks + self.freed_blocks, c.total_blocks - self.inflight_blocks)

    def reported(self) -> None:
        """A fresh capacity report arrived: it includes what the router saw finish."""
        self.last_seen = time.monotonic()
        self.freed_slots = self.freed_blocks = 0

    def blocks_for(self, num_tokens: int) -> int:
        bs = self.info.capacity.block_size or 1
        return -(-num_tokens // bs)


class NodeRegistry:
    def __init__(self, heartbeat_interval_s: float = 0.5, dead_after_s: float = 3.0):
        self.heartbeat_interval_s = heartbeat_interval_s
        self.dead_after_s = dead_after_s
        self.nodes: dict[str, NodeEntry] = {}
        self.static_addrs: dict[str, int] = {}  # address -> expected kind
        self.cond = threading.Condition()  # notified on any change that may admit a request

    # ---- registration ---------------------------------------------------------------------
    def register(self, info: pb.NodeInfo, static: bool = False) -> NodeEntry:
        with self.cond:
            old = self.nodes.get(info.node_id)
            if old is not None and old.info.incarnation == info.incarnation and old.info.address == info.address:
                old.info = info
                old.reported()
                if not old.alive:
                    log.info("node %s (%s) is back", info.node_id, info.address)
                old.alive = True
                self.cond.notify_all()
                return old
            e = NodeEntry(info=info, static=static or (old is not None and old.static))
            e.connect()
            if old is not None:
                old.close()
                log.info(
                    "node %s re-registered (incarnation %x -> %x)", info.node_id, old.info.incarnation, info.incarnation
                )
            else:
                log.info(
                    "node %s registered: %s at %s, tp=%d",
                    info.node_id, pb.NodeKind.Name(info.kind), info.address, info.tp_size,
                )  # fmt: skip
            self.nodes[info.node_id] = e
            self.cond.notify_all()
            return e

    def heartbeat(self, node_id: str, incarnation: int, capacity: pb.Capacity, draining: bool = False) -> bool:
        with self.cond:
            e = self.nodes.get(node_id)
            if e is None or e.info.incarnation != incarnation:
                return False
            e.info.capacity.CopyFrom(capacity)
            if draining and not e.info.draining:
                log.info("node %s is draining: no new requests go there", node_id)
            e.info.draining = draining
            e.reported()
            if not e.alive:
                log.info("node %s is back", node_id)
            e.alive = True
            self.cond.notify_all()
            return True

    def add_static(self, address: str, kind: int) -> None:
        self.static_addrs[address] = kind

    # ---- health -------------------------------------------------------------------------------
    def sweep(self) -> None:
        """Mark nodes without a recent heartbeat dead; poll static nodes that are not heartbeating."""
        now = time.monotonic()
        with self.cond:
            for e in self.nodes.values():
                if e.alive and now - e.last_seen > self.dead_after_s:
                    e.alive = False
                    log.warning(
                        "node %s (%s): no heartbeat for %.1f s, marked dead",
                        e.node_id,
                        e.info.address,
                        now - e.last_seen,
                    )
            fresh = {e.info.address for e in self.nodes.values() if now - e.last_seen < self.heartbeat_interval_s}
        for addr, kind in list(self.static_addrs.items()):
            if addr in fresh:
                continue
            ch = channel(addr)
            try:
                stub = rpc.DecodeNodeStub(ch) if kind == pb.NODE_KIND_DECODE else rpc.PrefillNodeStub(ch)
                info = stub.Stats(pb.StatsRequest(), timeout=1.0)
                self.register(info, static=True)
            except grpc.RpcError:
                pass
            finally:
                ch.close()

    def snapshot(self) -> list[tuple[NodeEntry, float]]:
        now = time.monotonic()
        with self.cond:
            return [(e, now - e.last_seen) for e in self.nodes.values()]

    def live(self, kind: int) -> list[NodeEntry]:
        with self.cond:  # re-entrant: callers may already hold it
            return [e for e in self.nodes.values() if e.alive and e.kind == kind]

    def routable(self, kind: int) -> list[NodeEntry]:
        """Live and not draining: nodes that may get new requests."""
        with self.cond:
            return [e for e in self.nodes.values() if e.alive and not e.info.draining and e.kind == kind]

    def mark_draining(self, e: NodeEntry) -> None:
        """The node refused a call because it drains (until a heartbeat says otherwise)."""
        with self.cond:
            if not e.info.draining:
                log.info("node %s is draining: no new requests go there", e.node_id)
            e.info.draining = True

    def close(self) -> None:
        with self.cond:
            for e in self.nodes.values():
                e.close()
