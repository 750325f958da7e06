"""AsyncClient: the asyncio SDK (grpc.aio), mirroring Client with await / async for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2

from client import args
from client.aio_mux import AsyncMuxedCall, AsyncTokenStreams
from client.chat import ChatProgress, ChatResult, chat_request, check_fields
from client.routers import GENERATION, Routers, StreamBase, connection, deadline, muxed_start
from client.types import GenerateResult, PdserveError, build_request, chunk_from, chunk_from_delta
from proto import pb


class AsyncTokenStream(StreamBase):
    """`async for` StreamChunks; `await close()` (or `async with`) cancels the request, and so does
    leaving the loop early (`break`, an exception, a cancelled task) or dropping the stream: as
    Client's TokenStream, an unfinished request does not decode on for nobody."""

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        yielded, finished = False, False
        try:
            while True:
                try:
                    async for m in self._call:
                        if self.closed:  # what came in before the close is not the caller's any more
                            return
                        yielded = True
                        self.got += m.token_ids
                        yield chunk_from_delta(m) if isinstance(m, pb.TokenDelta) else chunk_from(m)
                    finished = True
                    return
                except grpc.RpcError as e:
                    if not self._on_error(e, yielded):
                        return
        finally:  # GeneratorExit (left early: break, or the generator collected), CancelledError, errors
            if not finished:
                self._cancel()

    def _cancel(self) -> None:
        if not self.closed:
            self.closed = True
            self._call.cancel()

    async def close(self) -> None:
        self._cancel()

    cancel = close

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    def __del__(self):  # dropped unfinished (no `async with`, no close): the request ends with it
        try:
            self._cancel()
        except Exception:
            pass


class AsyncClient:
    def __init__(
        self,
        addr,
        timeout: float | None = None,
        api_key: str | None = None,
        tls_ca=None,
        tls_cert=None,
        tls_key=None,
        tls_server_name: str | None = None,
        token_streams: bool = True,
    ):
        """addr: one router's host:port, or several of the same pools ("a:1,b:2" or a list); the
        the rest as Client's (timeout=0: a deadline already past; a closed client raises
        PdserveError FAILED_PRECONDITION "the client is closed")."""
        self.timeout = args.timeout(timeout)
        self._r = Routers(addr, True, *connection(api_key, tls_ca, tls_cert, tls_key, tls_server_name))
        self._streams = AsyncTokenStreams(self._r.stubs, self._r.md) if token_streams else None
        self._first_model: str | None = None

    @property
    def addr(self) -> str:
        """The router calls go to first."""
        return self._r.addrs[self._r.cur]

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Until a router serves and knows at least one live model (node); TimeoutError after
        `timeout` seconds, PdserveError at once when every router refuses the API key."""
        self._r.check_open()
        r, until = self._r, time.monotonic() + args.number("timeout", timeout)
        while True:
            for i, a in enumerate(r.addrs):
                left = until - time.monotonic()
                if left <= 0:
                    raise r.not_ready(timeout)
                try:
                    h = await r.healths[i].Check(
                        health_pb2.HealthCheckRequest(service=GENERATION), timeout=min(left, 2.0)
                    )
                    if h.status != health_pb2.HealthCheckResponse.SERVING:
                        r.why[a] = "not serving"
                    elif (
                        await r.stubs[i].ListModels(pb.ListModelsRequest(), timeout=min(left, 2.0), metadata=r.md)
                    ).models:
                        r.use(i)
                        return
                    else:
                        r.why[a] = "no live node"
                except grpc.RpcError as e:
                    r.refusal(e, a)
            await asyncio.sleep(min(0.1, max(0.0, until - time.monotonic())))

    async def list_models(self, timeout: float | None = None) -> list[pb.ModelInfo]:
        """The models the current router serves; `timeout`: this call's deadline in seconds
        (default: the client's)."""
        self._r.check_open()
        t = deadline(timeout, self.timeout)
        try:
            got = await self._r.stubs[self._r.cur].ListModels(pb.ListModelsRequest(), timeout=t, metadata=self._r.md)
        except grpc.RpcError as e:
            raise PdserveError.from_rpc(e) from None
        return list(got.models)

    def stream(
        self, prompt: str | None = None, prompt_token_ids=None, timeout: float | None = None, **sampling
    ) -> AsyncTokenStream:
        """As Client.stream (the same arguments and options: max_tokens, temperature, ...,
        include_stop_str_in_output, skip_special_tokens, cache_salt, admission_timeout_s,
        priority): `async for` the chunks. `await close()`, leaving an `async with` block or the
        loop early (`break`), or dropping the stream cancels the request."""
        self._r.check_open()
        req = build_request(prompt, prompt_token_ids, **sampling)
        start = self._r.generate(req, deadline(timeout, self.timeout))
        return AsyncTokenStream(
            start
            if self._streams is None
            else muxed_start(start, req, self._streams, len(self._r.addrs), AsyncMuxedCall),
            self._r,
        )

    async def generate(
        self, prompt: str | None = None, prompt_token_ids=None, timeout: float | None = None, **sampling
    ) -> GenerateResult:
        """As Client.generate: the whole answer (`GenerateResult`); the arguments as `stream`'s."""
        res = GenerateResult()
        async with self.stream(prompt, prompt_token_ids, timeout=timeout, **sampling) as s:
            async for c in s:
                res.add(c)
        return res

    async def chat_stream(
        self,
        messages: list[dict],
        model: str | None = None,
        timeout: float | None = None,
        *,
        extra_body: dict | None = None,
        **fields,
    ) -> AsyncIterator[dict]:
        """As Client.chat_stream: OpenAI's chat chunks as dicts, then `{"usage": ...}`."""
        r = self._r
        r.check_open()
        check_fields(fields, extra_body)
        body = chat_request(messages, model or await self._model(), fields, extra_body)
        go = ChatProgress(body, len(r.addrs), r.cur)
        while True:
            call = go.call(r, deadline(timeout, self.timeout))
            try:
                async for m in call:
                    yield go.add(m)
                return
            except grpc.RpcError as e:
                r.check_open()  # closed under the call
                go.failed(e, r)
            finally:
                call.cancel()

    async def chat(
        self,
        messages: list[dict],
        model: str | None = None,
        timeout: float | None = None,
        *,
        extra_body: dict | None = None,
        **fields,
    ) -> ChatResult:
        """As Client.chat: the whole chat answer (`ChatResult`)."""
        res = ChatResult()
        async for chunk in self.chat_stream(messages, model, timeout, extra_body=extra_body, **fields):
            res.add(chunk)
        return res

    async def _model(self) -> str:
        if self._first_model is None:
            models = await self.list_models()
            if not models:
                raise PdserveError(grpc.StatusCode.UNAVAILABLE, "the router serves no model yet")
            self._first_model = models[0].id
        return self._first_model

    async def close(self) -> None:
        """As Client.close: streams under way end, later calls raise "the client is closed"."""
        if self._r.closed:
            return
        self._r.closed = True
        if self._streams is not None:
            await self._streams.close()
        for c in self._r.chans:
            await c.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
