"""gRPC plumbing shared by the router and the nodes: `start_server` (health, reflection, the
credentials given), `channel`, the `Heartbeater` thread, the drain's refusal (`DRAINING_KEY`,
`is_draining`) and its wait (`wait_idle`, woken by `Changes`, never on a timer), and a stream
ended because the node gave its memory up (`MEMORY_KEY`, `gave_memory_up`), and a handshake
refused because the peer's transfer agent is unreachable (`PEER_KEY`, `peer_at_fault`)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.vision.inputs import ImageInput
from engine.vision.processing import check_image
from proto import pb, rpc
from proto.convert import image_kwargs
from serving.security import OPEN, Credentials, NodeGuard, add_port
from serving.security import channel as secure_channel

log = logging.getLogger("pdserve.serving")

# Ids the engine accepts as request ids, and names a log line can carry.
MAX_REQUEST_ID_LEN = 128
# A node's largest incoming message (gRPC's default is 4 MiB): a prompt's images travel in one
# PrefillRequest / DecodeRequest, bounded by the router (router/images/prepare.py)
MAX_MESSAGE_BYTES = 256 << 20


# Trailing metadata on the UNAVAILABLE a draining server refuses new work with.
DRAINING_KEY = "pdserve-draining"
MEMORY_KEY = "pdserve-memory-given-up"
# On the UNAVAILABLE of a Handshake whose caller-named peer could not be connected to: the node
# that answered is fine, the peer (the value: its node id) is not.
PEER_KEY = "pdserve-peer-unreachable"


class HealthStatus(Protocol):
    """What the servers set on grpc_health's HealthServicer (it ships no type information)."""

    def set(self, service: str, status: int) -> None: ...
    def enter_graceful_shutdown(self) -> None: ...


class _Registry(Protocol):
    """The calls a node makes on the router's Registry (the generated stub is untyped)."""

    def Register(self, request: pb.RegisterRequest, timeout: float) -> pb.RegisterResponse: ...
    def Heartbeat(self, request: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatResponse: ...
    def ListNodes(self, request: pb.ListNodesRequest, timeout: float) -> pb.ListNodesResponse: ...


def images_of(
    msgs: Iterable[pb.ImageInput], context: grpc.ServicerContext, need_data: bool = True, model: str | None = None
) -> tuple[ImageInput, ...]:
    """A request's ImageInput messages as the engine's records; INVALID_ARGUMENT naming the image
    for a malformed one. With `model` (a checkpoint path), each image's bytes are decoded, hashed
    and sized here, in the RPC thread, so the engine loop's own check finds them checked
    (engine/vision/processing.py `check_image`)."""
    try:
        images = tuple(ImageInput(**kw) for kw in image_kwargs(msgs, need_data))
        if model is not None:
            for k, img in enumerate(images):
                check_image(model, k, img)
        return images
    except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        raise


def is_draining(err: grpc.RpcError) -> bool:
    """The call was refused because its server is draining (alive, finishing what it holds)."""
    try:
        md: Iterable[object] = err.trailing_metadata() or ()
    except Exception:  # not a call error (e.g. a cancelled future)
        return False
    # (key, value) pairs: named tuples from sync gRPC, plain tuples from grpc.aio
    return any(isinstance(m, tuple) and m[0] == DRAINING_KEY for m in md)


def gave_memory_up(err: grpc.RpcError) -> bool:
    """The node ended the stream because it gave the request's memory up and cannot recompute it
    there (an image request reserved without its pixels): place it again, with the tokens sent."""
    try:
        md: Iterable[object] = err.trailing_metadata() or ()
    except Exception:  # not a call error (e.g. a cancelled future)
        return False
    return any(isinstance(m, tuple) and m[0] == MEMORY_KEY for m in md)


def peer_at_fault(err: grpc.RpcError) -> str:
    """The peer node a Handshake named as unreachable (`refuse_peer`), or "": the failure, if any,
    is the answering node's own."""
    try:
        md: Iterable[object] = err.trailing_metadata() or ()
    except Exception:  # not a call error (e.g. a cancelled future)
        return ""
    return next((str(m[1]) for m in md if isinstance(m, tuple) and m[0] == PEER_KEY), "")


def refuse_peer(context: grpc.ServicerContext, peer: str, what: str) -> None:
    """End a Handshake with UNAVAILABLE, marked as the fault of the peer node `peer`."""
    context.set_trailing_metadata(((PEER_KEY, peer),))
    context.abort(grpc.StatusCode.UNAVAILABLE, what)


def refuse_memory(context: grpc.ServicerContext, what: str) -> None:
    """End the call with RESOURCE_EXHAUSTED, marked as memory given up (`gave_memory_up`)."""
    context.set_trailing_metadata(((MEMORY_KEY, "1"),))
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, what)


def refuse_draining(context: grpc.ServicerContext, what: str) -> None:
    """Abort the call with UNAVAILABLE, marked as a drain refusal (retry elsewhere)."""
    context.set_trailing_metadata(((DRAINING_KEY, "1"),))
    context.abort(grpc.StatusCode.UNAVAILABLE, f"{what} is draining (shutting down): send new requests elsewhere")


def not_serving(health_servicer: HealthStatus | None, service: str) -> None:
    """Mark one service NOT_SERVING (a readiness probe on it fails); the overall status ("",
    what a liveness probe asks) stays SERVING."""
    if health_servicer is not None:
        full = pb.DESCRIPTOR.services_by_name[service].full_name
        health_servicer.set(full, health_pb2.HealthCheckResponse.NOT_SERVING)


class Changes:
    """Wake-ups for whoever waits on a server's in-flight count (its drain): the code that changes
    what the count reads calls `changed()` after the change. A no-op while nobody waits; safe from
    any thread and from a signal handler (SimpleQueue.put is reentrant)."""

    def __init__(self) -> None:
        self._waiters: list[queue.SimpleQueue[None]] = []

    def changed(self) -> None:
        for w in list(self._waiters):
            w.put(None)


class Interrupt(threading.Event):
    """An Event that, once set, also wakes at once the `wait_idle` calls it was handed to; safe to
    set from a signal handler."""

    def __init__(self) -> None:
        super().__init__()
        self._waiters: list[queue.SimpleQueue[None]] = []

    def set(self) -> None:
        super().set()
        for w in list(self._waiters):
            w.put(None)


def wait_idle(
    what: str, in_flight: Callable[[], int], changes: Changes, timeout_s: float, interrupt: Interrupt | None = None
) -> bool:
    """Wait until in_flight() is 0, at most timeout_s or until `interrupt` is set; log the
    outcome. True when nothing was left. in_flight() is read again only when `changes` or
    `interrupt` signal, so the wait ends as soon as the count drops to 0, and costs nothing before."""
    if interrupt is not None and not isinstance(interrupt, Interrupt):
        raise TypeError("wait_idle's interrupt must be a serving.rpc.Interrupt (a plain Event would not wake it)")
    t0 = time.monotonic()
    wake: queue.SimpleQueue[None] = queue.SimpleQueue()
    sources = [changes._waiters, *([interrupt._waiters] if interrupt is not None else [])]
    for waiters in sources:  # before the first read: no change after it goes unseen
        waiters.append(wake)
    try:
        left = in_flight()
        log.info("%s draining: %d in flight; waiting up to %g s for them", what, left, timeout_s)
        while left and not (interrupt is not None and interrupt.is_set()):
            remaining = t0 + timeout_s - time.monotonic()
            if remaining <= 0:
                break
            try:
                wake.get(timeout=remaining)
                while True:  # one read for every change signalled so far
                    wake.get_nowait()
            except queue.Empty:
                pass
            left = in_flight()
    finally:
        for waiters in sources:
            waiters.remove(wake)
    if left:
        log.warning("%s drained for %.1f s; %d still in flight end now", what, time.monotonic() - t0, left)
    else:
        log.info("%s drained in %.1f s", what, time.monotonic() - t0)
    return not left


def start_server(
    addr: str,
    add_servicers: Callable[[grpc.Server], None],
    service_names: Iterable[str],
    max_workers: int = 64,
    creds: Credentials = OPEN,
) -> tuple[grpc.Server, int, HealthStatus]:
    """With creds.tls and a CA the server requires its callers' certificates (mutual TLS)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[NodeGuard(creds)] if creds.cluster_token else None,
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
    )
    add_servicers(server)
    hs: HealthStatus = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = [pb.DESCRIPTOR.services_by_name[n].full_name for n in service_names]
    for n in [*names, ""]:
        hs.set(n, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = add_port(server, addr, creds.tls, mutual=True)
    server.start()
    return server, port, hs


def channel(addr: str, creds: Credentials = OPEN) -> grpc.Channel:
    """A channel to a router or node: TLS with creds.tls, the cluster token on every call."""
    return secure_channel(addr, creds)


class Heartbeater:
    """Register `info()` with the router at `router_addr`, then send a heartbeat every interval."""

    def __init__(
        self,
        router_addr: str,
        info: Callable[[], pb.NodeInfo],
        interval_s: float = 0.5,
        creds: Credentials = OPEN,
        heard: Callable[[pb.HeartbeatResponse], None] | None = None,
    ) -> None:
        self.router_addr = router_addr
        self.info = info
        self.heard = heard  # each heartbeat's answer
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._chan = channel(router_addr, creds)
        self._stub: _Registry = rpc.RegistryStub(self._chan)
        self._registered = False
        self._prefix_version: int | None = None  # the prefix digest the router has (sent again only when it changed)
        self._warned = False
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeater:
        self.thread.start()
        return self

    def _beat(self) -> None:
        node = self.info()
        if not self._registered:
            r = self._stub.Register(pb.RegisterRequest(node=node), timeout=5)
            self.interval_s = r.heartbeat_interval_s or self.interval_s
            self._registered = True
            self._prefix_version = node.prefix.version if node.HasField("prefix") else None
            log.info("registered %s (%s) with the router at %s", node.node_id, node.address, self.router_addr)
            return
        req = pb.HeartbeatRequest(
            node_id=node.node_id,
            incarnation=node.incarnation,
            capacity=node.capacity,
            draining=node.draining,
            prefill_tokens_per_s=node.prefill_tokens_per_s,
            requests_ended=node.requests_ended,
            prefill_cost=node.prefill_cost if node.HasField("prefill_cost") else None,
        )
        if node.HasField("prefix") and node.prefix.version != self._prefix_version:
            req.prefix.CopyFrom(node.prefix)
        hb = self._stub.Heartbeat(req, timeout=5)
        if req.HasField("prefix"):
            self._prefix_version = req.prefix.version
        if not hb.known:
            self._registered = False
            self._beat()
        elif self.heard is not None:
            self.heard(hb)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._beat()
                self._warned = False
            except grpc.RpcError as e:
                self._registered = False
                if not self._warned:
                    code = e.code()
                    if code in (
                        grpc.StatusCode.UNAUTHENTICATED,
                        grpc.StatusCode.PERMISSION_DENIED,
                        grpc.StatusCode.ALREADY_EXISTS,
                    ):
                        log.error("router %s refused this node: %s; retrying", self.router_addr, e.details())
                    else:
                        log.warning("router %s unreachable (%s); retrying", self.router_addr, code.name)
                    self._warned = True
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def nodes(self, timeout: float = 2.0) -> list[pb.NodeStatus] | None:
        """The nodes this router knows, as it sees them; None when it cannot be asked."""
        try:
            return list(self._stub.ListNodes(pb.ListNodesRequest(), timeout=timeout).nodes)
        except grpc.RpcError:
            return None

    def beat_now(self) -> None:
        """Send the next heartbeat at once (the node's state changed: draining)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout=5)
        self._chan.close()
