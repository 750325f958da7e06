"""`pdserve_router_http_requests_total{route, status}`: every HTTP request the router answers, by
route (the API's routes by name, `other` for any other path, so a scanner cannot grow the label
set) and status (`499` for a client that left before the answer began). An ASGI middleware
outside the API-key check, so refusals count too (docs/api.md, "Prometheus metrics")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/ping",
        "/version",
        "/metrics",
    }
)


def route_of(path: str) -> str:
    if path in ROUTES:
        return path
    return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"


class HttpCounter:
    def __init__(self, app, registry: CollectorRegistry):
        self.app = app
        self.requests = Counter(
            "pdserve_router_http_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=registry,
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 499

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.requests.labels(route_of(scope["path"]), str(status)).inc()
