"""The lifecycle both node kinds share: start (gRPC server, registration and heartbeats to every
router, /metrics), drain (NOT_SERVING, new work refused, bounded wait for in-flight work) and
stop, plus the Stats and Handshake RPCs. docs/serving.md, "Module notes", has the sequence."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, TypeVar

import grpc
import msgspec

from proto import pb
from serving.probes import Answer, Probes
from serving.rpc import (
    Changes,
    Heartbeater,
    Interrupt,
    not_serving,
    refuse_draining,
    refuse_peer,
    start_server,
    wait_idle,
)
from serving.security import addresses, credentials

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from serving.config import NodeArgs
    from serving.loop import EngineLoop
    from serving.metrics import ServingMetrics
    from serving.rpc import HealthStatus
    from transfer.connector.base import RankEndpoints

log = logging.getLogger("pdserve.node")

_T = TypeVar("_T")

# handler threads beyond the streams, for Reserve, Release, Stats, Handshake and health checks
SHORT_CALL_THREADS = 32


class NodeServer:
    KIND: ClassVar[str] = ""  # "decode" | "prefill" | "encode"
    SERVICE: ClassVar[str] = ""  # its gRPC service in pdserve.proto
    NODE_KIND: ClassVar[pb.NodeKind] = pb.NODE_KIND_UNSPECIFIED
    # set by the subclass
    cfg: NodeArgs
    ecfg: EngineConfig
    engine: EngineCore
    loop: EngineLoop
    metrics: ServingMetrics
    incarnation: int
    digest: str
    backend: str
    connector: RankEndpoints | None

    def _init_lifecycle(self) -> None:
        self.address = ""
        self.server: grpc.Server | None = None
        self.metrics_port: int | None = None
        self.draining = False
        self._serving = False  # the gRPC server serves (start() is done)
        self._health: HealthStatus | None = None
        self._hbs: list[Heartbeater] = []  # one per router
        self._stopped = threading.Event()
        # signalled after every change of what in_flight() reads (the engine loop's passes, the
        # handlers' own maps): what the drain waits on
        self.changes = Changes()

    @property
    def name(self) -> str:
        return f"{self.KIND} node {self.cfg.node_id}"

    # ---- what the node reports (registration, heartbeats, Stats) ------------------------------
    def heard(self, hb: pb.HeartbeatResponse) -> None:
        """A heartbeat's answer from the router (the decode node reads it)."""

    def info(self) -> pb.NodeInfo:
        s = self.loop.snapshot
        info = pb.NodeInfo(
            node_id=self.cfg.node_id, kind=self.NODE_KIND, address=self.address, incarnation=self.incarnation,
            tp_size=self.cfg.tensor_parallel_size, model=self.cfg.model, vocab_size=self.ecfg.model.vocab_size,
            max_model_len=self.ecfg.max_model_len, schema_digest=self.digest, draining=self.draining,
            capacity=pb.Capacity(
                total_blocks=s.total_blocks, free_blocks=s.free_blocks, block_size=s.block_size,
                total_slots=s.total_slots, free_slots=s.free_slots, running=s.running, waiting=s.waiting,
                queued_prefill_tokens=s.queued_prefill_tokens, reserved=s.reserved,
            ),
            requests_ended=s.ended,
            prefill_tokens_per_s=s.prefill_tokens_per_s,
            prefill_cost=None if s.prefill_cost is None else pb.PrefillCost(s_per_token=s.prefill_cost.per_token, s_per_pair=s.prefill_cost.per_pair, s_per_token_min=s.prefill_cost.fastest),
            speculation=pb.Speculation(
                method=self.ecfg.speculative.method if self.ecfg.speculative.num_tokens else "",
                num_tokens=self.ecfg.speculative.num_tokens, drafts_per_position=s.spec_drafts_per_position,
                accepted_per_position=s.spec_accepted_per_position,
            ),
        )  # fmt: skip
        d = s.prefix_digest
        if d is not None:
            info.prefix.CopyFrom(
                pb.PrefixDigest(version=d.version, block_size=d.block_size, snapshot_interval=d.interval,
                                pages=d.pages, snapshot_keys=d.snapshot_keys, snapshot_tokens=d.snapshot_tokens,
                                mtp=d.mtp)
            )  # fmt: skip
        self._describe(info)
        return info

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.NodeInfo:
        return self.info()

    # ---- provided by the node --------------------------------------------------------------------
    def _describe(self, info: pb.NodeInfo) -> None:
        """Set the fields only this kind of node reports."""

    def in_flight(self) -> int:
        """Requests, reservations and pushes this node still holds."""
        raise NotImplementedError

    def _add_servicer(self, server: grpc.Server) -> None:
        raise NotImplementedError

    def summary(self) -> str:
        """What the start-up log line says the node holds."""
        return self.engine.capacity.summary()

    def _stop_work(self) -> None:
        """Stop what runs the node's work (the engine loop), before the gRPC server stops."""
        self.loop.stop()

    def _close(self) -> None:
        """Free what the node holds, once nothing drives it any more."""
        if self.connector is not None:
            self.connector.close()  # the loop has stopped: nothing else drives the endpoints
        self.engine.close()

    # ---- new work ----------------------------------------------------------------------------
    def loop_api(self, context: grpc.ServicerContext, fn: Callable[[], _T]) -> _T:
        """fn() (a call of the engine loop's API); the loop having stopped ends the RPC with
        UNAVAILABLE, and so does a wait for the loop that ran out (it was in one step all that
        time: a CPU computing a long prompt chunk of a wide model), which the caller may retry."""
        from serving.commands import ShuttingDown

        try:
            return fn()
        except ShuttingDown as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: {e}")
            raise  # abort raised already
        except TimeoutError:
            log.warning("%s: the engine loop did not answer in time (one step ran that long)", self.name)
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{self.name}: the engine loop did not answer in time (one step ran that long); try again, "
                "or lower --max-num-batched-tokens so that a step is shorter",
            )
            raise  # abort raised already

    def refuse_if_draining(self, context: grpc.ServicerContext) -> None:
        if self.draining:
            refuse_draining(context, self.name)

    # ---- lifecycle -----------------------------------------------------------------------------
    def handler_threads(self) -> int:
        """gRPC handler threads: a handler holds its thread for a whole stream, so one for every
        stream the engine can hold at once (a running or waiting request's, a reservation's: its
        state slots plus a running batch's worth waiting) and room for the short calls beside them.
        A fixed pool smaller than that stalled streams beyond it silently while the engine had room."""
        e = self.ecfg
        return e.scheduler.max_num_seqs + e.num_state_slots + SHORT_CALL_THREADS

    def start(self, addr: str) -> int:
        creds = credentials(self.cfg)  # the cluster token, TLS (serving/security.py)
        if self.cfg.metrics_port is not None:  # first: its /health says "starting" until the gRPC server serves
            bind = addr.rsplit(":", 1)[0].strip("[]")  # where the node binds (a wildcard: every interface)
            self.metrics_port = self.metrics.serve(bind, self.cfg.metrics_port, Probes(self.readiness, self.liveness))
        self.server, port, self._health = start_server(
            addr, self._add_servicer, [self.SERVICE], max_workers=self.handler_threads(), creds=creds
        )
        self.address = f"{self.cfg.advertise_host}:{port}"
        if self.cfg.router:
            hb = self.cfg.heartbeat_interval_s
            self._hbs = [Heartbeater(a, self.info, hb, creds, self.heard).start() for a in addresses(self.cfg.router)]
        self._serving = True
        log.info("%s serving on %s (%s)", self.name, self.address, self.summary())
        if self.metrics_port is not None:
            log.info("%s metrics at http://%s:%d/metrics", self.name, self.cfg.advertise_host, self.metrics_port)
        return port

    def readiness(self) -> Answer:
        """The metrics port's /health (serving/probes.py): 200 while the node takes new work, as
        its gRPC readiness (SERVING for its service) says."""
        if self._stopped.is_set():
            return 503, {"status": "stopping"}
        if self.draining:
            return 503, {"status": "draining"}
        if not self._serving:
            return 503, {"status": "starting"}
        return 200, {"status": "ok"}

    def liveness(self) -> Answer:
        """The metrics port's /live: 200 while the node runs (a drain too); 503 once it stops, or
        when it lost a tensor-parallel rank and can serve no more (`fatal`)."""
        if self._stopped.is_set():
            return 503, {"status": "stopping"}
        why = self.fatal
        return (503, {"status": "failed", "message": why}) if why else (200, {"status": "ok"})

    def drain(self, timeout_s: float, interrupt: Interrupt | None = None) -> bool:
        """Take no new work and wait (at most timeout_s, or until `interrupt` is set) for what is
        in flight to finish, woken by `changes`. True when nothing is left."""
        if not self.draining:
            self.draining = True
            not_serving(self._health, self.SERVICE)
            for hb in self._hbs:
                hb.beat_now()
        return wait_idle(self.name, self.in_flight, self.changes, timeout_s, interrupt)

    def stop(self, grace: float | None = 2.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        for hb in self._hbs:
            hb.stop()
        self._stop_work()
        self.metrics.stop()
        if self.server is not None:
            self.server.stop(grace).wait(timeout=(grace or 0) + 5)
        self._close()

    @property
    def fatal(self) -> str | None:
        """Why this node can serve no more (a tensor-parallel rank is gone: engine/executor.py
        WorkerLost), or None: the command line then stops it with a non-zero status, so that its
        supervisor (`pdserve up`, Kubernetes) sees it and restarts it (docs/serving.md)."""
        engine = getattr(self, "engine", None)
        return engine.executor.lost() if engine is not None else None

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        assert self.server is not None, "the node was not started"
        return self.server.wait_for_termination(timeout)

    # ---- the transfer handshake ----------------------------------------------------------------
    def Handshake(self, request: pb.HandshakeRequest, context: grpc.ServicerContext) -> pb.HandshakeResponse:
        """Add the caller's rank blobs as peers on every rank; answer with ours."""
        conn = self.connector
        if conn is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} has no transfer endpoint")
        peers = msgspec.msgpack.decode(request.schema, type=list[bytes]) if request.schema else []
        if peers:
            from transfer.errors import HandshakeError, PeerUnreachable

            try:  # on the loop thread, like every other use of the endpoints
                self.loop_api(context, lambda: self.loop.call(lambda e: conn.add_peers(peers)))
            except HandshakeError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"handshake with {request.node_id} refused: {e}")
            except PeerUnreachable as e:  # the caller's peer is at fault, not this node: one line, its name
                what = f"handshake with {request.node_id} failed: {e}"
                log.warning("%s", what)
                refuse_peer(context, request.node_id, f"{self.name}: {what}")
            log.info("handshake with %s (%d ranks)", request.node_id, len(peers))
        return pb.HandshakeResponse(
            node_id=self.cfg.node_id, incarnation=self.incarnation, schema=msgspec.msgpack.encode(conn.blobs)
        )

    def drop_dead_node(self, context: grpc.ServicerContext, node: str) -> None:
        """A router declared the peer `node` dead (Release's dead_prefill_node, Abort's
        dead_decode_node): drop its transfer agents on every rank, so that a transfer with it fails
        now rather than after the wait a write to a vanished peer takes. No-op for "" or a node with
        no transfer endpoint."""
        conn = self.connector
        if not node or conn is None:
            return
        gone = self.loop_api(context, lambda: self.loop.call(lambda e: conn.drop_node(node)))
        if gone:
            log.warning("dropped the transfer agents of %s (declared dead): %s", node, ", ".join(gone))


def on_cancel(context: grpc.ServicerContext, fn: Callable[[], None]) -> None:
    """Run fn once the RPC ends (the caller cancelled, or the call is over); at once when it
    already has: what wakes a handler that waits on the engine loop when its caller goes away."""
    if not context.add_callback(fn):
        fn()


_Node = TypeVar("_Node", bound=NodeServer)


def serve_node(node: _Node, addr: str) -> tuple[_Node, int]:
    """Start a constructed node on addr ("host:0" picks a port); stop it when that fails."""
    try:
        port = node.start(addr)
    except Exception:
        node.stop(0)
        raise
    return node, port
