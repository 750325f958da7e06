"""Where the router's sockets are made, each with its credentials: `start_grpc` (the grpc.aio
server behind `AioGuard`), `node_channel` (calls to nodes, the cluster token on each) and
`start_http` (ASGI apps on uvicorn on the running loop)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterable

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import pb
from router.auth import AioGuard, KeyLimits
from serving.security import OPEN, Credentials, Tls, add_port, channel_credentials, channel_options, token_metadata


class _AioMeta:
    """Adds the cluster token to every call (aio client interceptors: the kinds the router makes)."""

    def __init__(self, md):
        self.md = md

    def _details(self, d):
        return d._replace(metadata=grpc.aio.Metadata(*(d.metadata or ()), *self.md))


class _UnaryMeta(_AioMeta, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, d, request):
        return await continuation(self._details(d), request)


class _StreamMeta(_AioMeta, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, d, request):
        return await continuation(self._details(d), request)


def node_channel(addr: str, creds: Credentials = OPEN) -> grpc.aio.Channel:
    md = token_metadata(creds)
    icp = [_UnaryMeta(md), _StreamMeta(md)] if md else None
    if creds.tls is not None:
        return grpc.aio.secure_channel(
            addr, channel_credentials(creds.tls), options=channel_options(creds.tls), interceptors=icp
        )
    return grpc.aio.insecure_channel(addr, options=channel_options(None), interceptors=icp)


async def start_grpc(
    addr: str,
    add_servicers: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    creds: Credentials = OPEN,
    limits: KeyLimits | None = None,
    max_message_bytes: int = 4 << 20,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    guarded = creds.cluster_token or creds.api_keys
    icp = [AioGuard(creds, limits or KeyLimits(0))] if guarded else None
    opts = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", max_message_bytes)]
    server = grpc.aio.server(interceptors=icp, options=opts)
    add_servicers(server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = [pb.DESCRIPTOR.services_by_name[n].full_name for n in service_names]
    for n in [*names, ""]:
        await hs.set(n, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = add_port(server, addr, creds.tls, mutual=False)
    await server.start()
    return server, port, hs


class HttpServer:
    """One uvicorn server on the running loop (no signal handlers of its own: the router drains)."""

    def __init__(self, server: uvicorn.Server, port: int):
        self.server, self.port = server, port

    async def stop(self) -> None:
        self.server.force_exit = True  # in-flight streams were drained (or given up on) already
        await self.server.shutdown()


async def start_http(app, host: str, port: int, tls: Tls | None = None, guard=None, what: str = "HTTP") -> HttpServer:
    # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so (with proto 0, a
    # response's body waits behind its headers for the client's delayed ACK, ~40 ms)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        flag = "--metrics-port" if what == "metrics" else "--http-port"
        raise OSError(f"cannot bind {what} {host}:{port}: {e.strerror} (choose another {flag})") from None
    sock.setblocking(False)
    if guard is not None:
        app = guard(app)
    cfg = uvicorn.Config(
        app,
        lifespan="off",
        access_log=False,
        log_config=None,
        date_header=False,
        timeout_graceful_shutdown=1,
        ws="none",
        **_https(tls),
    )
    cfg.load()
    server = uvicorn.Server(cfg)
    server.lifespan = cfg.lifespan_class(cfg)
    await server.startup(sockets=[sock])
    await asyncio.sleep(0)
    return HttpServer(server, sock.getsockname()[1])


def _https(tls: Tls | None) -> dict:
    """uvicorn's TLS settings (it reads the files itself)."""
    if tls is None or tls.cert is None:
        return {}
    if not (tls.cert_file and tls.key_file):
        raise ValueError("HTTPS needs the certificate and key as files (--tls-cert, --tls-key)")
    return {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
