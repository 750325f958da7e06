"""What a sender and a receiver share: a rank's schema, its transport, its peers, the handshake,
and the poll loop that turns control payloads into protocol events (`metadata()`, `add_peer`,
`poll()`; never blocks)."""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import ClassVar, Literal, Protocol, TypeVar

from engine.cache.allocator import CachePools
from engine.cache.block_manager import BlockManager, SlotPool
from engine.config import EngineConfig
from engine.devices import StepFence
from transfer.backend import TransferState, Transport, byte_view, get_transport
from transfer.config import TransferConfig
from transfer.errors import PeerUnreachable
from transfer.handshake import check_peer
from transfer.links import check_link, local_host
from transfer.messages import Control, decode_control, encode_control
from transfer.netif import ucx_net_devices
from transfer.plan import RegionPair
from transfer.schema import SCHEMA_VERSION, PeerInfo, build_schema, decode_peer, encode

log = logging.getLogger(__name__)


class Tracked(Protocol):
    """What `Endpoint.wait` reads of a request (SendRequest, RecvRequest)."""

    @property
    def request_id(self) -> str: ...

    @property
    def state(self) -> TransferState: ...


R = TypeVar("R", bound=Tracked)


def _terminal(request: Tracked) -> bool:
    return request.state.terminal


class Peer:
    """A connected peer rank and the region pairs between it and this rank (source -> destination)."""

    def __init__(self, info: PeerInfo, pairs: tuple[RegionPair, ...]) -> None:
        self.info = info
        self.pairs = pairs

    @property
    def agent(self) -> str:
        return self.info.agent

    @property
    def rank(self) -> int:
        return self.info.schema.tp_rank


class Endpoint:
    role: ClassVar[Literal["sender", "receiver"]]

    def __init__(
        self,
        cfg: EngineConfig,
        rank: int,
        pools: CachePools,
        node: str,
        config: TransferConfig | None = None,
        *,
        blocks: BlockManager | None = None,
        slots: SlotPool | None = None,
        fence: StepFence | None = None,
    ) -> None:
        """fence: recorded by the rank after each step; a sender waits on it before a write reads
        the pools (engine/devices.py)."""
        self.config = config or TransferConfig()
        self.fence = fence
        self.cfg, self.rank, self.pools, self.node = cfg, rank, pools, node
        self.schema = build_schema(cfg, rank, pools)
        self.digest = self.schema.digest.fingerprint()
        self.incarnation = secrets.token_hex(4)
        self.agent = f"{node}.{self.role}.r{rank}.{self.incarnation}"
        cap = pools.capacity
        self.blocks = blocks or BlockManager(cap.num_blocks, cap.block_size)
        self.slots = slots or SlotPool(cap.num_state_slots)
        regions = {(layer, kind): t for kind, layer, t in pools.tensors()}
        opts = (
            {"progress_thread": self.config.nixl_progress_thread}
            if self.config.backend == "nixl"
            else {"error_handling": self.config.ucxx_error_handling}
        )
        with ucx_net_devices(self.config.bind_host):  # the UCX context reads it when it is made
            self.transport: Transport = get_transport(self.config.backend)(self.agent, regions, **opts)
        memory = next((str(t.device) for _, _, t in pools.tensors()), "cpu")
        self.info = PeerInfo(
            SCHEMA_VERSION,
            self.config.backend,
            self.agent,
            self.incarnation,
            node,
            self.role,
            self.schema,
            self.transport.metadata(),
            local_host(memory, self.config.backend == "ucxx" and not self.config.ucxx_error_handling),
        )
        self.peers: dict[str, Peer] = {}
        self.stale: deque[str] = deque(maxlen=256)  # messages ignored as stale or foreign, newest last
        self._closed = False
        # byte views of the pools for the end-to-end checksum, read on both sides
        self.views = {k: byte_view(t) for k, t in self.transport.regions.items()} if self.config.checksum else {}
        self._init_role()

    def _init_role(self) -> None:
        """The role's own state, set up after the endpoint's (a subclass hook)."""

    # -- peers ---------------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This endpoint's PeerInfo, to publish to peers."""
        return encode(self.info)

    def add_peer(self, blob: bytes) -> str:
        """Handshake with a peer from its published metadata; returns its agent name.

        Raises HandshakeError when the peer cannot exchange state with this rank. A peer that
        replaces an older incarnation of the same (node, rank) removes the old one first.
        """
        info = decode_peer(blob)
        check_peer(self.info, info)
        ln = check_link(self.info.host, info.host, self.config.allow_tcp_staging)
        for old in list(self.peers.values()):
            if old.info.node == info.node and old.rank == info.schema.tp_rank and old.agent != info.agent:
                self.remove_peer(old.agent, f"replaced by incarnation {info.incarnation}")
        if info.agent in self.peers:
            return info.agent
        peer = Peer(info, self._pairs(info))
        try:
            self.transport.add_peer(info.agent, info.transport)
        except PeerUnreachable as e:
            raise PeerUnreachable(e.why, info.node, info.agent) from None
        try:
            self._peer_added(peer)
        except Exception:
            self.transport.remove_peer(info.agent)
            raise
        self.peers[info.agent] = peer
        log.info("transfer %s -> %s: UCX over %s", self.agent, info.agent, ln.transports)
        return info.agent

    def remove_peer(self, agent: str, reason: str = "declared dead") -> None:
        """Drop a peer's agent (it died or restarted): its requests fail and are freed when safe."""
        peer = self.peers.pop(agent, None)
        if peer is None:
            return
        self.transport.remove_peer(agent)  # first: its posted receives are cancelled, handles released
        self._peer_removed(peer, reason)

    def _pairs(self, info: PeerInfo) -> tuple[RegionPair, ...]:
        raise NotImplementedError

    def _peer_added(self, peer: Peer) -> None:
        pass

    def _peer_removed(self, peer: Peer, reason: str) -> None:
        pass

    # -- control -------------------------------------------------------------------------------

    def _send(self, agent: str, msg: Control) -> bool:
        """Send a control message; a peer that cannot be reached is logged, not raised (it may
        be dead: the router's remove_peer, a lease or a timeout settles the request)."""
        if agent not in self.peers:
            log.warning("%s: not sending %s to unknown agent %s", self.agent, type(msg).__name__, agent)
            return False
        try:
            self.transport.send_control(agent, encode_control(msg))
        except Exception as e:  # noqa: BLE001 (backends raise their own error types)
            log.warning("%s: %s to %s not sent: %s", self.agent, type(msg).__name__, agent, e)
            return False
        return True

    def _stale(self, why: str) -> None:
        log.info("%s: ignored %s", self.agent, why)
        self.stale.append(why)

    def poll(self) -> None:
        """Progress the transport, handle control messages, advance every request. Never blocks."""
        self.transport.progress()
        for payload in self.transport.poll_control():
            msg = decode_control(payload)
            if msg is None:
                self._stale(f"undecodable notification of {len(payload)} bytes")
                continue
            self._handle(msg)
        self._tick(time.monotonic())

    def _handle(self, msg: Control) -> None:
        raise NotImplementedError

    def _tick(self, now: float) -> None:
        raise NotImplementedError

    def wait(self, request: R, timeout_s: float, until: Callable[[R], bool] = _terminal, sleep_s: float = 0.0005) -> R:
        """Poll until `until(request)` or raise TimeoutError naming the request's state."""
        deadline = time.monotonic() + timeout_s
        while not until(request):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.agent}: request {request.request_id} still {request.state.value} after {timeout_s:.1f} s"
                )
            self.poll()
            if sleep_s:
                time.sleep(sleep_s)
        return request

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.transport.close()


__all__ = ["Endpoint", "Peer", "TransferState", "Tracked"]
