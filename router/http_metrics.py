"""`pdserve_router_http_requests_total{route, status}`: every HTTP request the router answers, by
route (the API's routes by name, `/v1/models/{id}` and `/v1/responses/{id}` for their ids, `other`
for any other path, so a scanner cannot grow the label set) and status (`499` for a client that
left before the answer began). An ASGI middleware outside the API-key check, so refusals count
too (docs/api.md, "Prometheus metrics"). It also logs each refusal (status 400 and up, 401s
included) in one line with its method, path, status, time and error message: a request refused
before it reached the service has no `request ...` line of its own."""

from __future__ import annotations

import json
import logging
import time

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("pdserve.router")

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
ERROR_BODY_BYTES = 4096  # of an error answer kept for its message (OpenAI's and Anthropic's are short)


def route_of(path: str) -> str:
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    if path.startswith("/v1/responses/") and path.count("/") in (3, 4):
        return "/v1/responses/{id}/input_items" if path.endswith("/input_items") else "/v1/responses/{id}"
    return "other"


def error_message(body: bytes) -> str:
    """The message of an OpenAI or Anthropic error body (`{"error": {"message": ...}}`), else the
    body's text; one line, at most 200 characters."""
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = None
    text = msg if isinstance(msg, str) else body.decode("utf-8", "replace")
    text = " ".join(text.split())
    return text[:200] + ("..." if len(text) > 200 else "")


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
        body = bytearray()
        t0 = time.perf_counter()

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < ERROR_BODY_BYTES:
                body.extend(message.get("body", b"")[: ERROR_BODY_BYTES - len(body)])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = route_of(scope["path"])
            self.requests.labels(route, str(status)).inc()
            if status >= 400:
                path = scope["path"][:120]
                log.log(
                    logging.WARNING if 500 <= status < 600 and status != 503 else logging.INFO,
                    "http %s %s: %d in %.1f ms%s",
                    scope.get("method", "-"),
                    path if path.isprintable() else ascii(path),
                    status,
                    (time.perf_counter() - t0) * 1e3,
                    f": {error_message(bytes(body))}" if body else "",
                )
