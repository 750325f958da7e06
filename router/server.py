"""The router process: one asyncio loop serving gRPC (`Generation`, `Registry`), the OpenAI HTTP
app and `/metrics`, the calls to the nodes and the heartbeat sweep, over one `GenerateService`;
the drain on SIGTERM. `serve(addr, cfg)` returns (handle, port) for callers that are not async."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import make_asgi_app

from engine import heap
from proto import pb
from router.auth import HttpGuard, KeyLimits
from router.config import RouterConfig
from router.console import say
from router.grpc_api import add_services
from router.health import probes
from router.net import HttpServer, start_grpc, start_http
from router.service import GenerateService
from serving.probes import asgi
from serving.security import Credentials, credentials

log = logging.getLogger("pdserve.router")


class Router:
    def __init__(self, cfg: RouterConfig, creds: Credentials | None = None):
        """creds: what the router accepts and presents; by default read as its options say
        (--cluster-token-file or PDSERVE_CLUSTER_TOKEN, API keys, TLS files)."""
        self.cfg = cfg
        self.creds = credentials(cfg, api_keys=True) if creds is None else creds
        self.limits = KeyLimits(cfg.max_requests_per_key)
        self.service = GenerateService(cfg, self.creds)
        if cfg.model and self.service.tokenizer is None:  # said at start, not at the first text prompt
            log.warning("%s has no tokenizer.json: text prompts and chat need one (token ids are served)", cfg.model)
        self.registry, self.prefill, self.metrics = self.service.registry, self.service.prefill, self.service.metrics
        self.server = None
        self._health = None
        self._https: list[HttpServer] = []
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self._sweeper: asyncio.Task | None = None
        self._stopped = False
        self._front = None  # the OpenAI routes' front, one for HTTP and gRPC Chat (`front`)
        self._ready = True  # Generation's readiness as last set (start_grpc sets SERVING)
        self._readiness_due = False

    def front(self):
        """The chat path's front (router/openai_api.py), made on first use: its HTTP stack loads
        only when the router serves HTTP or a Chat call."""
        if self._front is None:
            from router.openai_api import OpenAIFront

            self._front = OpenAIFront(self.service)
        return self._front

    @property
    def draining(self) -> bool:
        return self.service.draining

    @property
    def stopped(self) -> bool:
        return self._stopped

    async def start(self, addr: str) -> int:
        loop, me = asyncio.get_running_loop(), threading.get_ident()
        wake = self.service.admission.wake

        def on_loop() -> None:
            wake()
            if not self._readiness_due:
                self._readiness_due = True
                loop.create_task(self._readiness())

        def changed() -> None:  # from the loop, or a thread that touched the registry
            if threading.get_ident() == me:
                on_loop()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(on_loop)

        self.registry.loop, self.registry.on_change = loop, changed
        self.server, port, self._health = await start_grpc(
            addr,
            lambda s: add_services(s, self.service, self.front),
            ["Generation", "Registry"],
            self.creds,
            self.limits,
            self.cfg.max_body_bytes,  # a Generate message's images are bounded as an HTTP body's
        )
        await self._readiness()  # no decode node yet: not ready
        self._sweeper = loop.create_task(self._sweep())
        log.info("router serving on port %d (policy %s; %s)", port, self.service.policy.name, self.creds.describe())
        try:
            await self._start_http()
        except BaseException:  # a busy port: what started is stopped here, not left to the collector
            await self.stop(0)
            raise
        return port

    async def _start_http(self) -> None:
        """/metrics and the OpenAI HTTP API, each where its option asks."""
        host, tls = self.cfg.host, self.creds.tls
        scheme = "https" if tls is not None and tls.cert is not None else "http"
        if self.cfg.metrics_port is not None:
            app = asgi(make_asgi_app(self.metrics.registry), probes(self))  # and /health, /live
            h = await start_http(app, host, self.cfg.metrics_port, what="metrics")
            self._https.append(h)
            self.metrics_port = h.port
            log.info("router metrics at http://%s:%d/metrics", host, self.metrics_port)
        if self.cfg.http_port is not None:
            from router.http_metrics import HttpCounter
            from router.openai_api import make_app

            registry = self.metrics.registry
            guard = lambda app: HttpCounter(HttpGuard(app, self.creds, self.limits), registry)  # noqa: E731
            h = await start_http(make_app(self.service, self.front()), host, self.cfg.http_port, tls, guard)
            self._https.append(h)
            self.http_port = h.port
            log.info("router OpenAI-compatible HTTP at %s://%s:%d/v1", scheme, host, self.http_port)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval_s)
            try:
                for e in await self.registry.sweep():
                    if e.kind == pb.NODE_KIND_DECODE:
                        self._decode_dead(e)
                with self.registry.lock:  # what is kept per node goes with a restarted or forgotten node
                    known = {e.node_id: e.info.incarnation for e in self.registry.nodes.values()}
                self.service.prefill.prune(known)
                self.service.prefill.meter.keep(set(known))
                # pairs a node's registration did not make: a prefill node ready since, static nodes
                self.service.prefill.warm_pairs()
                await self._readiness()  # a node declared dead or unreachable calls no on_change
            except Exception:
                log.exception("registry sweep failed")

    async def _readiness(self) -> None:
        """Generation's readiness (what a Kubernetes readiness probe asks): SERVING while a decode
        node takes new requests and the router does not drain, as HTTP `/health` answers 200;
        NOT_SERVING otherwise, while the overall status (liveness) stays SERVING. A router with no
        decode node would only queue requests and refuse them: its pod leaves the Service's
        endpoints, and comes back when one registers (nodes reach it by the headless Service)."""
        self._readiness_due = False
        if self._health is None or self._stopped:
            return
        ready = not self.service.draining and bool(self.registry.routable(pb.NODE_KIND_DECODE))
        if ready == self._ready:
            return
        self._ready = ready
        full = pb.DESCRIPTOR.services_by_name["Generation"].full_name
        status = health_pb2.HealthCheckResponse
        await self._health.set(full, status.SERVING if ready else status.NOT_SERVING)
        if not self.service.draining:
            log.info("router %s", "ready: a decode node takes requests" if ready else "not ready: no decode node")

    def _decode_dead(self, d) -> None:
        """The heartbeats declared D dead: each live prefill node drops D's transfer agents, so a
        push to D ends now, not after a write's 30 s timeout (docs/router.md); its pairs are
        handshaken again if it comes back."""
        self.service.prefill.forget_decode(d)

        async def tell(p) -> None:
            try:
                await p.stub.Abort(pb.AbortRequest(dead_decode_node=d.node_id, reason="declared dead"), timeout=10)
            except grpc.RpcError as e:
                log.info("telling %s that %s is dead failed: %s", p.node_id, d.node_id, e.code().name)

        for p in self.registry.live(pb.NODE_KIND_PREFILL):
            self.service.spawn(tell(p))

    async def drain(self, timeout_s: float, interrupt: asyncio.Event | None = None) -> bool:
        """Refuse new requests (UNAVAILABLE, `pdserve-draining`; readiness NOT_SERVING) and wait,
        at most timeout_s or until `interrupt` is set, for those in flight. True: none left."""
        svc = self.service
        if not svc.draining:
            svc.draining = True
            self._ready = False
            if self._health is not None:
                full = pb.DESCRIPTOR.services_by_name["Generation"].full_name
                await self._health.set(full, health_pb2.HealthCheckResponse.NOT_SERVING)
        t0 = time.monotonic()
        log.info("router draining: %d in flight; waiting up to %g s for them", svc.active, timeout_s)
        waits = [asyncio.ensure_future(svc.idle.wait())]
        if interrupt is not None:
            waits.append(asyncio.ensure_future(interrupt.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if svc.active:
            log.warning("router drained for %.1f s; %d still in flight end now", time.monotonic() - t0, svc.active)
        else:
            log.info("router drained in %.1f s", time.monotonic() - t0)
        return not svc.active

    async def stop(self, grace: float | None = 2.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        for h in self._https:
            await h.stop()
        self.service.client_streams.close_all()  # their calls end with the server's stop
        if self.server is not None:
            await self.server.stop(grace)
        await self.service.close()


def run(
    cfg: RouterConfig, port: int, port_file: str | None, drain_timeout: float, creds: Credentials | None = None
) -> int:
    """`pdserve router`: serve until SIGINT / SIGTERM; then drain (take nothing new, let what is in
    flight finish, at most drain_timeout seconds; a second signal cuts it short) and stop."""

    async def main() -> int:
        router = Router(cfg, creds)
        bound = await router.start(f"{cfg.host}:{port}")
        stop, now = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # before it says where it listens: a signal then drains
            loop.add_signal_handler(sig, lambda: (now if stop.is_set() else stop).set())
        if port_file:
            tmp = Path(port_file + ".tmp")
            tmp.write_text(str(bound))
            tmp.rename(port_file)
        heap.settle()  # the tokenizers and the server are loaded: out of the collector's walk
        say(f"router listening on {cfg.host}:{bound}")
        if router.http_port is not None:
            scheme = "https" if cfg.tls_cert else "http"
            say(f"router OpenAI-compatible HTTP on {scheme}://{cfg.host}:{router.http_port}/v1")
        else:  # OpenAI-style clients are most users: say how to get it
            say("router: gRPC only; add --http-port 8000 for the OpenAI-compatible HTTP API (/v1)")
        await stop.wait()
        if drain_timeout > 0:
            await router.drain(drain_timeout, interrupt=now)
        await router.stop()
        return 0

    return asyncio.run(main())


class BackgroundRouter:
    """A Router on an event loop thread of its own, driven from ordinary (non-async) code: its
    `registry` and `prefill` are the router's; `drain` and `stop` wait for the loop."""

    def __init__(self, cfg: RouterConfig, creds: Credentials | None = None):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-loop", daemon=True)
        self._thread.start()
        self.router = Router(cfg, creds)
        self.registry, self.prefill, self.service = self.router.registry, self.router.prefill, self.router.service

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, addr: str) -> int:
        try:
            return self._call(self.router.start(addr))
        except BaseException:
            self.stop(0)
            raise

    @property
    def http_port(self) -> int | None:
        return self.router.http_port

    @property
    def metrics_port(self) -> int | None:
        return self.router.metrics_port

    def drain(self, timeout_s: float) -> bool:
        return self._call(self.router.drain(timeout_s))

    def stop(self, grace: float | None = 2.0) -> None:
        if self.loop.is_closed():
            return
        try:
            self._call(self.router.stop(grace), timeout=(grace or 0) + 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()


__all__ = ["BackgroundRouter", "Router", "RouterConfig", "run", "serve"]


def serve(addr: str, cfg: RouterConfig, creds: Credentials | None = None) -> tuple[BackgroundRouter, int]:
    r = BackgroundRouter(cfg, creds)
    return r, r.start(addr)
