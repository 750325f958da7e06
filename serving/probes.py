"""Plain-HTTP health probes beside Prometheus' `/metrics` on every server's `--metrics-port`, which
stays plain HTTP when the server's gRPC and API ports speak TLS: what a Kubernetes `httpGet` probe
asks where its gRPC probe cannot (deploy/k8s/components/tls).

- `GET /health`, readiness: 200 only while the server takes new work; 503 otherwise, the JSON body
  saying why (`status`: a node's `starting` / `draining` / `stopping`, a router's `no_decode_node` /
  `draining`). The same answer as the gRPC health service's for the server's own service.
- `GET /live`, liveness: 200 while the process serves (a drain included); 503 once it stops, or
  when a node lost a tensor-parallel rank (it can serve no more: a restart is the cure).

Each server gives its two answers as callables (`Probes`); `wsgi` and `asgi` put them in front of
the metrics app of a node (a WSGI thread) and of the router (ASGI on its event loop)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

HEALTH, LIVE = "/health", "/live"
PATHS = (HEALTH, LIVE)  # what the manifests' httpGet probes may name (tests/deploy checks them)

Answer = tuple[int, dict[str, Any]]  # HTTP status, JSON body
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


@dataclass(frozen=True)
class Probes:
    """A server's readiness and liveness, each answered when asked (from any thread)."""

    ready: Callable[[], Answer]
    live: Callable[[], Answer]

    def answer(self, method: str, path: str) -> tuple[int, bytes] | None:
        """The probe's (status, JSON body) for a request, or None when `path` is no probe's."""
        fn = {HEALTH: self.ready, LIVE: self.live}.get(path.rstrip("/") or path)
        if fn is None:
            return None
        if method not in ("GET", "HEAD"):
            return 405, json.dumps({"status": "method_not_allowed"}).encode()
        status, body = fn()
        return status, json.dumps(body).encode()


def wsgi(app: Callable, probes: Probes) -> Callable:
    """A WSGI app answering the probes' paths and passing every other request to `app`."""

    def serve(environ: dict, start_response: Callable) -> Iterable[bytes]:
        got = probes.answer(environ.get("REQUEST_METHOD", "GET"), environ.get("PATH_INFO", ""))
        if got is None:
            return app(environ, start_response)
        status, body = got
        start_response(f"{status} {_REASONS[status]}", [("Content-Type", "application/json")])
        return [body]

    return serve


def asgi(app: Callable, probes: Probes) -> Callable:
    """An ASGI app answering the probes' paths and passing every other request to `app`."""

    async def serve(scope: dict, receive: Callable, send: Callable) -> None:
        got = probes.answer(scope.get("method", "GET"), scope.get("path", "")) if scope["type"] == "http" else None
        if got is None:
            await app(scope, receive, send)
            return
        status, body = got
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return serve
