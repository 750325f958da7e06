"""The router's checks of who calls it: `AioGuard` (gRPC: API keys on `Generation`, the cluster
token on `Registry`), `HttpGuard` (the same for the OpenAI HTTP app) and `KeyLimits` (requests in
flight per key). Keys are never logged (serving/security.py has the planes and secrets)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from contextlib import aclosing

import grpc

from serving.security import AUTH_KEY, Credentials, authorization, bearer, key_id, match, refusal, refusing_handler

log = logging.getLogger("pdserve.router")

OPEN_PATHS = ("/health", "/ping", "/version", "/metrics")
_GENERATE = "/pdserve.v1.Generation/Generate"


class KeyLimits:
    """At most `limit` requests in flight per key digest (0: no limit)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held: Counter[bytes] = Counter()

    def take(self, d: bytes) -> bool:
        if self.limit and self.held[d] >= self.limit:
            return False
        self.held[d] += 1
        return True

    def give(self, d: bytes) -> None:
        self.held[d] -= 1
        if self.held[d] <= 0:
            del self.held[d]

    def refusal(self, d: bytes) -> str:
        return f"API key {key_id(d)} has {self.held[d]} requests in flight, its limit (--max-requests-per-key)"


class AioGuard(grpc.aio.ServerInterceptor):
    def __init__(self, creds: Credentials, limits: KeyLimits):
        self.creds, self.limits = creds, limits

    async def intercept_service(self, continuation, details):
        h = await continuation(details)
        if h is None:
            return h
        md = details.invocation_metadata or ()
        why = refusal(details.method, md, self.creds)
        if why is not None:
            log.info("refused %s: %s", details.method, why[1])
            return refusing_handler(h, *why, aio=True)
        if details.method != _GENERATE or not (self.limits.limit and self.creds.api_keys):
            return h
        d = match(bearer(next((v for k, v in md if k == AUTH_KEY), None)), self.creds.api_keys)
        return self._limited(h, d)

    def _limited(self, h, d: bytes):
        limits, inner = self.limits, h.unary_stream

        async def generate(request, context):
            if not limits.take(d):
                log.info("refused Generate: %s", limits.refusal(d))
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, limits.refusal(d))
            try:
                async with aclosing(inner(request, context)) as it:
                    async for m in it:
                        yield m
            finally:
                limits.give(d)

        return grpc.unary_stream_rpc_method_handler(generate, h.request_deserializer, h.response_serializer)


def _error(status: int, message: str, type_: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


class HttpGuard:
    """ASGI middleware in front of the OpenAI app (router/net.py puts it there)."""

    def __init__(self, app, creds: Credentials, limits: KeyLimits):
        self.app, self.creds, self.limits = app, creds, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.creds.api_keys or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = {k: v.decode("latin-1") for k, v in scope["headers"] if k in (b"authorization", b"x-api-key")}
        d = match(bearer(authorization(headers.get(b"authorization"), headers.get(b"x-api-key"))), self.creds.api_keys)
        if d is None:
            log.info("refused HTTP %s %s: missing or invalid API key", scope["method"], scope["path"])
            msg = "missing or invalid API key: send the header 'Authorization: Bearer KEY' (or 'x-api-key: KEY')"
            return await _reply(
                send,
                401,
                _error(401, msg, "invalid_request_error", "invalid_api_key"),
                [(b"www-authenticate", b"Bearer")],
            )
        if scope["method"] != "POST" or not self.limits.limit:
            return await self.app(scope, receive, send)
        if not self.limits.take(d):
            log.info("refused HTTP %s: %s", scope["path"], self.limits.refusal(d))
            body = _error(429, self.limits.refusal(d), "rate_limit_error", "too_many_requests_in_flight")
            return await _reply(send, 429, body, [(b"retry-after", b"1")])
        try:
            await self.app(scope, receive, send)
        finally:
            self.limits.give(d)


async def _reply(send, status: int, body: bytes, headers: list) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})
