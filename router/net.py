"""Where the router's sockets are made: its gRPC server, its channels to nodes, its HTTP servers.

Every listener and channel of the router comes from here, so credentials (TLS, API keys for
clients, a cluster token for nodes) are added in one place:

- `start_grpc(addr, add_servicers, names)`: a `grpc.aio` server with health checking and
  reflection for the named services; returns (server, port, health servicer).
- `node_channel(addr)`: the aio channel the router calls a node on (Reserve, Prefill, Generate,
  Release, Handshake, Stats).
- `start_http(app, host, port)`: an ASGI app (the OpenAI API, /metrics) served by uvicorn on the
  running loop, on a socket bound here (port 0 picks one); returns an `HttpServer`.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterable

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import pb

_CHANNEL_OPTIONS = [("grpc.enable_retries", 0)]


def node_channel(addr: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(addr, options=_CHANNEL_OPTIONS)


async def start_grpc(
    addr: str, add_servicers: Callable[[grpc.aio.Server], None], service_names: Iterable[str]
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    add_servicers(server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = [pb.DESCRIPTOR.services_by_name[n].full_name for n in service_names]
    for n in [*names, ""]:
        await hs.set(n, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        port = server.add_insecure_port(addr)
    except RuntimeError as e:
        raise OSError(f"cannot bind {addr}: {e}") from None
    if port == 0:
        raise OSError(f"cannot bind {addr}")
    await server.start()
    return server, port, hs


class HttpServer:
    """One uvicorn server on the running loop (no signal handlers of its own: the router drains)."""

    def __init__(self, server: uvicorn.Server, port: int):
        self.server, self.port = server, port

    async def stop(self) -> None:
        self.server.force_exit = True  # in-flight streams were drained (or given up on) already
        await self.server.shutdown()


async def start_http(app, host: str, port: int) -> HttpServer:
    # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so (with proto 0, a
    # response's body waits behind its headers for the client's delayed ACK, ~40 ms)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind HTTP {host}:{port}: {e.strerror}") from None
    sock.setblocking(False)
    cfg = uvicorn.Config(app, lifespan="off", access_log=False, log_config=None, date_header=False,
                         timeout_graceful_shutdown=1, ws="none")  # fmt: skip
    cfg.load()
    server = uvicorn.Server(cfg)
    server.lifespan = cfg.lifespan_class(cfg)
    await server.startup(sockets=[sock])
    await asyncio.sleep(0)
    return HttpServer(server, sock.getsockname()[1])
