"""How the router's request path unwinds: `Abort` ends the client's call with a status; a
`DecodeFailed` is a decode node refusing or failing a reservation (tried on another node)."""

from __future__ import annotations

import grpc

# what every front door (gRPC, HTTP /v1/*, /health) says while no decode node takes requests
NO_DECODE = "no decode node is ready: start one or wait"


class DecodeFailed(Exception):
    """The decode node refused or could not take a reservation (retry on another decode node)."""

    def __init__(self, err: grpc.RpcError):
        super().__init__(str(err))
        self.err = err


class Abort(Exception):
    retry_after_s: float | None = None  # a refusal's estimate of when to come back (Retry-After)

    def __init__(self, code: grpc.StatusCode, msg: str):
        super().__init__(msg)
        self.code, self.msg = code, msg


class Draining(Abort):
    """The router (or a node) drains: UNAVAILABLE, marked so that a caller retries elsewhere
    (gRPC: the `pdserve-draining` trailing metadata; HTTP: 503 with Retry-After)."""

    def __init__(self, what: str):
        super().__init__(
            grpc.StatusCode.UNAVAILABLE, f"{what} is draining (shutting down): send new requests elsewhere"
        )
