"""Who may call what: the client plane (`Generation`) takes a client API key, the node plane the
cluster token, health and reflection are open; `Credentials` holds what a process presents and
accepts (compared in constant time, never logged), `NodeGuard` guards node servers, `channel`
dials with TLS and the token (docs/deploy.md, "Security")."""

from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

import grpc
import grpc.aio

from serving.hosts import unresolved

log = logging.getLogger("pdserve.security")

TOKEN_KEY = "pdserve-cluster-token"  # metadata of the node plane
AUTH_KEY = "authorization"  # metadata of the client plane: "Bearer KEY"
TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
API_KEY_ENV = "PDSERVE_API_KEY"  # one key, or several comma-separated

CLIENT_SERVICES = ("Generation",)
NODE_SERVICES = ("Registry", "DecodeNode", "PrefillNode", "EncodeNode")

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Metadata = tuple[tuple[str, str | bytes], ...]  # gRPC call metadata: (key, value) pairs


@functools.cache
def _prefixes(names: tuple[str, ...]) -> tuple[str, ...]:
    # The stubs load on first use, not at import: the CLI's tooling commands (make-tiny-model)
    # import this module through the launcher and must run where only the engine's packages are.
    from proto import pb

    return tuple(f"/{pb.DESCRIPTOR.services_by_name[n].full_name}/" for n in names)


def plane(method: str) -> str | None:
    """ "client", "node" or None (open: health, reflection) for a full method name."""
    if method.startswith(_prefixes(NODE_SERVICES)):
        return "node"
    if method.startswith(_prefixes(CLIENT_SERVICES)):
        return "client"
    return None


def digest(secret: str | bytes) -> bytes:
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).digest()


def key_id(d: bytes) -> str:
    """How logs and metrics name a key: the first 8 hex digits of its SHA-256."""
    return d.hex()[:8]


def match(given: str | bytes | None, digests: tuple[bytes, ...]) -> bytes | None:
    """The digest of the key among `digests` that `given` is, or None; every digest is compared
    (constant time, whichever matches)."""
    if given is None or not digests:
        return None
    g, hit = digest(given), None
    for d in digests:
        if hmac.compare_digest(g, d):
            hit = d
    return hit


def authorization(value: str | None, api_key: str | None) -> str | None:
    """The `Authorization` value of an HTTP request: its own, else one from an `x-api-key` header
    (how Anthropic's clients send their key)."""
    return value if value is not None else f"Bearer {api_key}" if api_key else None


def bearer(value: str | None) -> str | None:
    """The key of an `authorization: Bearer KEY` value."""
    if not value:
        return None
    scheme, _, key = value.strip().partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


@dataclass(frozen=True, repr=False)
class Tls:
    """PEM bytes: this process's certificate and key, and the CA its peers' certificates chain to."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    server_name: str | None = None
    cert_file: str | None = None  # where cert and key were read from (HTTPS servers read files)
    key_file: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together")

    @classmethod
    def from_files(
        cls, cert: str | None = None, key: str | None = None, ca: str | None = None, server_name: str | None = None
    ) -> Tls | None:
        """None when no file is named (no TLS)."""
        if not (cert or key or ca):
            return None

        def pem(path: str | None, what: str) -> bytes | None:
            return read_file(path, what) if path else None

        return cls(
            pem(cert, "--tls-cert"),
            pem(key, "--tls-key"),
            pem(ca, "--tls-ca"),
            server_name=server_name,
            cert_file=cert,
            key_file=key,
        )

    def __repr__(self) -> str:
        return f"Tls(cert={self.cert is not None}, ca={self.ca is not None}, server_name={self.server_name!r})"


@dataclass(frozen=True, repr=False)
class Credentials:
    """What one process accepts and presents. Empty: an open cluster without TLS (in-process
    servers, tests); the command line refuses to start a server that way unless told to."""

    cluster_token: bytes | None = None  # the node plane's shared secret
    api_keys: tuple[bytes, ...] = ()  # digests of the client keys (router); none: the client plane is open
    tls: Tls | None = None

    @property
    def token_digest(self) -> tuple[bytes, ...]:
        return (digest(self.cluster_token),) if self.cluster_token else ()

    def __repr__(self) -> str:  # never the secrets
        return (
            f"Credentials(cluster_token={'set' if self.cluster_token else 'none'}, "
            f"api_keys={len(self.api_keys)}, tls={self.tls!r})"
        )

    def describe(self) -> str:
        """For a start-up log line, in words and never the secrets."""
        token = "cluster token set" if self.cluster_token else "no cluster token (open node plane)"
        keys = (
            f"{len(self.api_keys)} client API key{'s' if len(self.api_keys) != 1 else ''}"
            if self.api_keys
            else "no client API keys"
        )
        tls = (
            "TLS off" if self.tls is None else "TLS" + (" with client certificates" if self.tls.ca is not None else "")
        )
        return f"{token}, {keys}, {tls}"


OPEN = Credentials()


def read_file(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what} {path}: {e.strerror}") from None


def read_token(path: str | None, env: Mapping[str, str]) -> bytes | None:
    """The cluster token from a file (surrounding whitespace dropped) or the environment."""
    raw = read_file(path, "--cluster-token-file").strip() if path else env.get(TOKEN_ENV, "").strip().encode()
    if path and not raw:
        raise ValueError(f"--cluster-token-file {path} is empty")
    if not all(33 <= b < 127 for b in raw):  # it travels as gRPC metadata
        raise ValueError("the cluster token must be printable ASCII without spaces")
    return raw or None


def read_api_keys(
    keys: Iterable[str] = (), path: str | None = None, env: Mapping[str, str] | None = None
) -> tuple[bytes, ...]:
    """Digests of the client keys: given ones, a file's lines (blank and `#` lines skipped) and
    PDSERVE_API_KEY (comma-separated)."""
    found = [k.strip() for k in keys]
    if path:
        lines = read_file(path, "--api-key-file").decode().splitlines()
        found += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    found += (env or {}).get(API_KEY_ENV, "").split(",")
    return tuple(dict.fromkeys(digest(k) for k in found if k))


class SecurityOptions(Protocol):
    """The fields of serving.config.SecurityArgs read here (named, not imported: the client SDK
    takes this module without the servers' configuration)."""

    @property
    def cluster_token_file(self) -> str | None: ...
    @property
    def tls_cert(self) -> str | None: ...
    @property
    def tls_key(self) -> str | None: ...
    @property
    def tls_ca(self) -> str | None: ...
    @property
    def tls_server_name(self) -> str | None: ...


@runtime_checkable
class ApiKeyOptions(Protocol):
    """The router's client-key fields (router.config.RouterConfig)."""

    @property
    def api_key(self) -> tuple[str, ...]: ...
    @property
    def api_key_file(self) -> str | None: ...


def credentials(args: SecurityOptions, env: Mapping[str, str] | None = None, *, api_keys: bool = False) -> Credentials:
    """A server's Credentials from its config (serving.config.SecurityArgs fields; the router's
    api_key fields with `api_keys`) and the environment."""
    env = os.environ if env is None else env
    tls = Tls.from_files(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    keys: tuple[bytes, ...] = ()
    if api_keys:
        if not isinstance(args, ApiKeyOptions):
            raise TypeError(f"{type(args).__name__} has no api_key / api_key_file fields")
        keys = read_api_keys(args.api_key, args.api_key_file, env)
    return Credentials(read_token(args.cluster_token_file, env), keys, tls)


def require_token(creds: Credentials, insecure_open_cluster: bool, what: str) -> None:
    """A server process starts with a cluster token, or open only when told so (a warning)."""
    if creds.cluster_token:
        return
    if not insecure_open_cluster:
        raise ValueError(
            f"{what}: no cluster token (give --cluster-token-file or {TOKEN_ENV}; "
            "--insecure-open-cluster runs the node plane open to anyone who can reach it)"
        )
    log.warning("%s: --insecure-open-cluster: any process that reaches it can join the cluster", what)


# ---- servers ---------------------------------------------------------------------------------
def server_credentials(tls: Tls, mutual: bool) -> grpc.ServerCredentials:
    if tls.cert is None or tls.key is None:
        raise ValueError("a TLS server needs --tls-cert and --tls-key")
    return grpc.ssl_server_credentials(
        [(tls.key, tls.cert)], root_certificates=tls.ca if mutual else None, require_client_auth=mutual and bool(tls.ca)
    )


def add_port(server: grpc.Server | grpc.aio.Server, addr: str, tls: Tls | None, mutual: bool) -> int:
    """Bind addr (plain, or TLS with `tls.cert`; `mutual`: callers must show a certificate the CA
    signed). Returns the port; OSError naming addr when it cannot bind (a port in use is found
    first, so gRPC's own log line about it never comes)."""
    port_free(addr)
    try:
        if tls is not None and tls.cert is not None:
            port = server.add_secure_port(addr, server_credentials(tls, mutual))
        else:
            port = server.add_insecure_port(addr)
    except RuntimeError as e:
        raise OSError(f"cannot bind {addr}: {e}") from None
    if port == 0:
        raise OSError(f"cannot bind {addr}")
    return port


def port_free(addr: str) -> None:
    """OSError when addr's host does not resolve (before gRPC logs its own line about it) or its
    port is in use (a numeric port other than 0)."""
    host, _, port = addr.rpartition(":")
    why = unresolved(host)
    if why is not None:
        raise OSError(f"cannot bind {addr}: {why}")
    host = host.strip("[]")
    if not port.isdigit() or int(port) == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return  # gRPC says what is wrong with the address
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a port in TIME_WAIT is free
        try:
            s.bind(sockaddr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(f"cannot bind {addr}: address already in use (choose another --port)") from None


def refusal(
    method: str, md: Iterable[tuple[str, str | bytes]], creds: Credentials
) -> tuple[grpc.StatusCode, str] | None:
    """Why a call of `method` with invocation metadata `md` is refused (status, message), or None."""
    p = plane(method)
    if p == "node" and creds.cluster_token:
        given = next((v for k, v in md if k == TOKEN_KEY), None)
        if given is None:
            return grpc.StatusCode.UNAUTHENTICATED, "the node plane needs the cluster token"
        if match(given, creds.token_digest) is None:
            return grpc.StatusCode.PERMISSION_DENIED, "wrong cluster token"
    elif p == "client" and creds.api_keys:
        auth = next((v for k, v in md if k == AUTH_KEY), None)  # a str: the key does not end in -bin
        if match(bearer(auth if isinstance(auth, str) else None), creds.api_keys) is None:
            return grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (metadata authorization: Bearer KEY)"
    return None


def refusing_handler(
    h: grpc.RpcMethodHandler[Req, Resp], code: grpc.StatusCode, msg: str, aio: bool
) -> grpc.RpcMethodHandler[Req, Resp]:
    """A handler of h's kind that ends every call with (code, msg)."""
    if aio:

        async def aio_unary(req: object, ctx: grpc.aio.ServicerContext[object, object]) -> None:
            await ctx.abort(code, msg)

        async def aio_stream(req: object, ctx: grpc.aio.ServicerContext[object, object]) -> AsyncIterator[None]:
            await ctx.abort(code, msg)
            yield  # an async generator, as a streaming handler is

        return _same_kind(h, aio_stream if h.response_streaming else aio_unary)

    def unary(req: object, ctx: grpc.ServicerContext) -> None:
        ctx.abort(code, msg)

    def stream(req: object, ctx: grpc.ServicerContext) -> Iterator[None]:
        ctx.abort(code, msg)
        yield

    return _same_kind(h, stream if h.response_streaming else unary)


def _same_kind(h: grpc.RpcMethodHandler[Req, Resp], behaviour: grpc._Behaviour) -> grpc.RpcMethodHandler[Req, Resp]:
    """A handler of h's streaming kind and serializers that runs `behaviour`."""
    des, ser = h.request_deserializer, h.response_serializer
    if h.request_streaming:
        if h.response_streaming:
            return grpc.stream_stream_rpc_method_handler(behaviour, des, ser)
        return grpc.stream_unary_rpc_method_handler(behaviour, des, ser)
    if h.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behaviour, des, ser)
    return grpc.unary_unary_rpc_method_handler(behaviour, des, ser)


class NodeGuard(grpc.ServerInterceptor):
    """A sync server's check (the nodes): the node plane needs the cluster token."""

    def __init__(self, creds: Credentials) -> None:
        self.creds = creds

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Req, Resp] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Req, Resp] | None:
        h = continuation(details)
        if h is None:
            return None
        why = refusal(details.method, details.invocation_metadata or (), self.creds)
        if why is None:
            return h
        log.info("refused %s: %s", details.method, why[1])
        return refusing_handler(h, *why, aio=False)


# ---- clients ---------------------------------------------------------------------------------
def addresses(spec: str | Iterable[str] | None) -> list[str]:
    """Router addresses from "host:port", "a:1,b:2" or a list of them (nodes' --router, the SDK).
    Empty for None or ""."""
    items = [spec or ""] if isinstance(spec, str | None) else list(spec)
    return [a.strip() for item in items for a in item.split(",") if a.strip()]


def channel_credentials(tls: Tls) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)


def channel_options(tls: Tls | None) -> list[tuple[str, object]]:
    opts: list[tuple[str, object]] = [("grpc.enable_retries", 0)]
    if tls is not None and tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return opts


@dataclass
class _CallDetails(grpc.ClientCallDetails):
    """A call's details passed on by an interceptor (gRPC reads these attributes back)."""

    method: str
    timeout: float | None
    metadata: Metadata | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class SyncMeta(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata to every call of a sync channel (a client interceptor of each kind)."""

    def __init__(self, md: tuple[tuple[str, str], ...]) -> None:
        self.md = md

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        md = (*(d.metadata or ()), *self.md)
        return _CallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Req], grpc._CallFuture[Resp]],
        client_call_details: grpc.ClientCallDetails,
        request: Req,
    ) -> grpc._CallFuture[Resp]:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Req], grpc._CallIterator[Resp]],
        client_call_details: grpc.ClientCallDetails,
        request: Req,
    ) -> grpc._CallIterator[Resp]:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Iterator[Req]], grpc._CallFuture[Resp]],
        client_call_details: grpc.ClientCallDetails,
        request_iterator: Iterator[Req],
    ) -> grpc._CallFuture[Resp]:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Iterator[Req]], grpc._CallIterator[Resp]],
        client_call_details: grpc.ClientCallDetails,
        request_iterator: Iterator[Req],
    ) -> grpc._CallIterator[Resp]:
        return continuation(self._details(client_call_details), request_iterator)


def token_metadata(creds: Credentials) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_KEY, creds.cluster_token.decode()),) if creds.cluster_token else ()


def channel(addr: str, creds: Credentials = OPEN) -> grpc.Channel:
    """A sync channel to a router or node: TLS with `creds.tls`, the cluster token on every call."""
    tls = creds.tls
    if tls is not None:
        ch = grpc.secure_channel(addr, channel_credentials(tls), options=channel_options(tls))
    else:
        ch = grpc.insecure_channel(addr, options=channel_options(None))
    md = token_metadata(creds)
    return grpc.intercept_channel(ch, SyncMeta(md)) if md else ch
