"""The routers a client talks to, shared by Client and AsyncClient.

Several routers can front the same pools ("a:1,b:2" or a list). Calls go to the current one; a
call that fails UNAVAILABLE is made again on the next router, each router once, and that router
becomes the current one: before its first token as it was, after it with the tokens received as
`resume_token_ids`, so the stream goes on from the next token.
"""

from __future__ import annotations

import os
import uuid

import grpc
from grpc_health.v1 import health_pb2_grpc

from client import args
from client.types import PdserveError
from proto import pb, rpc
from serving.security import API_KEY_ENV, AUTH_KEY, Tls, addresses, channel_credentials, channel_options, read_file

GENERATION = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED.name, grpc.StatusCode.PERMISSION_DENIED.name)


def connection(api_key: str | None, tls_ca, tls_cert, tls_key, tls_server_name) -> tuple:
    """(call metadata, Tls or None) from the SDK's arguments: the key (else PDSERVE_API_KEY, its
    first key), surrounding whitespace dropped (a key read from a file ends in a newline), as
    `authorization: Bearer KEY`; TLS when a CA or a client certificate is given, each PEM bytes,
    PEM text (a str starting "-----BEGIN") or a file path. ValueError for a key a header cannot
    carry, or a certificate without its key."""
    if api_key is not None and not isinstance(api_key, str):
        raise TypeError(f"api_key must be a str, not {type(api_key).__name__}")
    key = (api_key if api_key is not None else os.environ.get(API_KEY_ENV, "").split(",")[0]).strip()
    if not all(" " <= ch <= "~" for ch in key):  # it travels as gRPC metadata: printable ASCII
        where = "api_key" if api_key is not None else API_KEY_ENV
        raise ValueError(f"{where}: an API key is printable ASCII (it travels as the authorization header)")
    md = ((AUTH_KEY, f"Bearer {key}"),) if key else ()
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key go together: the client's certificate and its private key")
    pems = [_pem(v, what) for v, what in ((tls_cert, "tls_cert"), (tls_key, "tls_key"), (tls_ca, "tls_ca"))]
    tls = Tls(*pems, server_name=tls_server_name) if any(p is not None for p in pems) else None
    return md, tls


def _pem(v, what: str) -> bytes | None:
    """PEM bytes from PEM bytes, PEM text or a file path (str or os.PathLike)."""
    if v is None or isinstance(v, bytes):
        return v
    if isinstance(v, str) and v.lstrip().startswith("-----BEGIN"):
        return v.encode()
    if not isinstance(v, (str, os.PathLike)):
        raise TypeError(f"{what} must be PEM bytes, PEM text or a file path, not {type(v).__name__}")
    return read_file(os.fspath(v), what)


def deadline(timeout, default: float | None) -> float | None:
    """A call's timeout: its own when given (0 or less: already past, DEADLINE_EXCEEDED), else the
    client's."""
    return default if timeout is None else args.timeout(timeout)


class Routers:
    """One channel (Generation and Health stubs) per router; `cur` is where calls go first;
    `md` goes with every call (the API key)."""

    def __init__(self, addr, aio: bool, md: tuple = (), tls: Tls | None = None):
        self.addrs = addresses(addr)
        if not self.addrs:
            raise ValueError("give at least one router address (host:port)")
        self.md = md
        mod = grpc.aio if aio else grpc
        if tls is not None:
            creds, opts = channel_credentials(tls), channel_options(tls)
            self.chans = [mod.secure_channel(a, creds, options=opts) for a in self.addrs]
        else:
            self.chans = [mod.insecure_channel(a, options=channel_options(None)) for a in self.addrs]
        self.stubs = [rpc.GenerationStub(c) for c in self.chans]
        self.healths = [health_pb2_grpc.HealthStub(c) for c in self.chans]
        self.cur = 0
        self.why: dict[str, str] = {}  # per router, why it was not ready at the last check
        self.closed = False  # the client closed its channels

    def check_open(self) -> None:
        """PdserveError FAILED_PRECONDITION once the client is closed (gRPC's own errors on a
        closed channel, ValueError or grpc.aio.UsageError, said nothing of it)."""
        if self.closed:
            raise closed_error()

    def use(self, i: int) -> None:
        self.cur = i % len(self.addrs)

    def generate(self, req: pb.GenerateRequest, timeout: float | None):
        """`start(i, got)` for a stream: the Generate call on router i, resuming after the tokens
        `got` when there are any."""

        def start(i: int, got: list[int]):
            r = req
            if got:
                r = pb.GenerateRequest()
                r.CopyFrom(req)
                r.resume_token_ids.extend(got)
            return self.stubs[i % len(self.stubs)].Generate(r, timeout=timeout, metadata=self.md)

        return start

    def refusal(self, e: grpc.RpcError, addr: str) -> None:
        """Records why `addr` was not ready; raises PdserveError once every router has refused the
        credentials (UNAUTHENTICATED, PERMISSION_DENIED): waiting cannot change that answer, and a
        wrong key waited out the whole readiness timeout before."""
        self.why[addr] = e.code().name
        if all(self.why.get(a) in _REFUSED for a in self.addrs):
            raise PdserveError.from_rpc(e) from None

    def not_ready(self, timeout: float) -> TimeoutError:
        why = ", ".join(f"{a}: {self.why.get(a, 'not reachable')}" for a in self.addrs)
        return TimeoutError(f"no router ready after {timeout:g} s ({why})")


class StreamBase:
    """A Generate call that fails over to the next router, resuming after the tokens it has."""

    def __init__(self, start, routers: Routers):
        self._start, self._routers = start, routers
        self._i = routers.cur
        self._left = len(routers.addrs) - 1
        self.got: list[int] = []  # the tokens received (the iterators add them)
        self._call = start(self._i, self.got)
        self.closed = False

    def _on_error(self, e: grpc.RpcError, yielded: bool) -> bool:
        """After the call failed: True when it was made again on the next router (go on), False
        when closing the stream ended it; raises PdserveError otherwise."""
        if self.closed and e.code() == grpc.StatusCode.CANCELLED:
            return False
        if self._routers.closed:  # the client closed under the stream
            raise closed_error() from None
        if self._left > 0 and not self.closed and e.code() == grpc.StatusCode.UNAVAILABLE:
            self._left -= 1
            self._i += 1
            self._call = self._start(self._i, self.got)
            self._routers.use(self._i)
            return True
        raise PdserveError.from_rpc(e) from None


def closed_error() -> PdserveError:
    return PdserveError(grpc.StatusCode.FAILED_PRECONDITION, "the client is closed")


def muxed_start(start, req: pb.GenerateRequest, streams, n: int, wrap):
    """`start` (Routers.generate's) naming router i's token stream from `streams` (client/mux.py or
    client/aio_mux.py), its call wrapped by `wrap(call, stream, request_id, queue)`; as it is for
    a router whose stream is closed or already carries this request id."""
    if not req.request_id:  # the stream's deltas are keyed by it
        req.request_id = uuid.uuid4().hex
    rid = req.request_id

    def go(i: int, got: list[int]):
        s = streams.stream(i % n)
        q = s.register(rid) if s is not None else None
        if s is None or q is None:
            req.token_stream = ""
            return start(i, got)
        req.token_stream = s.stream_id
        try:
            return wrap(start(i, got), s, rid, q)
        except BaseException:
            s.unregister(rid)
            raise

    return go
