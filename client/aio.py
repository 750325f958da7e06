"""AsyncClient: the asyncio SDK (grpc.aio), mirroring Client with await / async for."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.sync import GENERATION
from client.types import GenerateResult, PdserveError, Failover, addresses, build_request, chunk_from
from proto import pb, rpc


class AsyncTokenStream:
    """`async for` StreamChunks; `await close()` (or `async with`) cancels the request. Fails over
    to the next router like client.sync.TokenStream."""

    def __init__(self, start, first: int = 0, routers: int = 1, on_switch=None):
        self._routes = Failover(start, first, routers, on_switch)
        self.closed = False

    @property
    def _call(self):
        return self._routes.call

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        yielded = False
        while True:
            try:
                async for m in self._call:
                    yielded = True
                    yield chunk_from(m)
                return
            except grpc.RpcError as e:
                if self.closed and e.code() == grpc.StatusCode.CANCELLED:
                    return
                if self._routes.retry(e, yielded, self.closed):
                    continue
                raise PdserveError.from_rpc(e) from None
            except asyncio.CancelledError:
                self._call.cancel()
                raise

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._call.cancel()

    cancel = close

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class AsyncClient:
    def __init__(self, addr, timeout: float | None = None):
        """addr: one router's host:port, or several of the same pools ("a:1,b:2" or a list)."""
        self.addrs = addresses(addr)
        self.timeout = timeout
        self._chans = [grpc.aio.insecure_channel(a) for a in self.addrs]
        self._stubs = [rpc.GenerationStub(c) for c in self._chans]
        self._healths = [health_pb2_grpc.HealthStub(c) for c in self._chans]
        self._cur = 0

    @property
    def addr(self) -> str:
        return self.addrs[self._cur]

    def _use(self, i: int) -> None:
        self._cur = i % len(self.addrs)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        last: dict[str, str] = {}
        while True:
            for i in range(len(self.addrs)):
                left = deadline - time.monotonic()
                if left <= 0:
                    why = ", ".join(f"{a}: {last.get(a, 'not reachable')}" for a in self.addrs)
                    raise TimeoutError(f"no router ready after {timeout:g} s ({why})")
                try:
                    r = await self._healths[i].Check(health_pb2.HealthCheckRequest(service=GENERATION),
                                                     timeout=min(left, 2.0))  # fmt: skip
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        if (await self._stubs[i].ListModels(pb.ListModelsRequest(), timeout=min(left, 2.0))).models:
                            self._use(i)
                            return
                        last[self.addrs[i]] = "no live node"
                    else:
                        last[self.addrs[i]] = "not serving"
                except grpc.RpcError as e:
                    last[self.addrs[i]] = e.code().name
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    async def list_models(self) -> list[pb.ModelInfo]:
        try:
            return list((await self._stubs[self._cur].ListModels(pb.ListModelsRequest(), timeout=self.timeout)).models)
        except grpc.RpcError as e:
            raise PdserveError.from_rpc(e) from None

    def stream(
        self, prompt: str | None = None, prompt_token_ids=None, timeout: float | None = None, **sampling
    ) -> AsyncTokenStream:
        req = build_request(prompt, prompt_token_ids, **sampling)
        n = len(self.addrs)
        return AsyncTokenStream(lambda i: self._stubs[i % n].Generate(req, timeout=timeout or self.timeout),
                                self._cur, n, self._use)  # fmt: skip

    async def generate(
        self, prompt: str | None = None, prompt_token_ids=None, timeout: float | None = None, **sampling
    ) -> GenerateResult:
        res = GenerateResult()
        async with self.stream(prompt, prompt_token_ids, timeout=timeout, **sampling) as s:
            async for c in s:
                res.add(c)
        return res

    async def close(self) -> None:
        for c in self._chans:
            await c.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
