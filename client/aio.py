"""AsyncClient: the asyncio SDK (grpc.aio), mirroring Client with await / async for."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.sync import GENERATION
from client.types import GenerateResult, PdserveError, build_request, chunk_from
from proto import pb, rpc


class AsyncTokenStream:
    """`async for` StreamChunks; `await close()` (or `async with`) cancels the request."""

    def __init__(self, call):
        self._call = call
        self.closed = False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        try:
            async for m in self._call:
                yield chunk_from(m)
        except grpc.RpcError as e:
            if self.closed and e.code() == grpc.StatusCode.CANCELLED:
                return
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
    def __init__(self, addr: str, timeout: float | None = None):
        self.addr = addr
        self.timeout = timeout
        self._chan = grpc.aio.insecure_channel(addr)
        self._stub = rpc.GenerationStub(self._chan)
        self._health = health_pb2_grpc.HealthStub(self._chan)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        last = "not reachable"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"router {self.addr} not ready after {timeout:g} s ({last})")
            try:
                r = await self._health.Check(health_pb2.HealthCheckRequest(service=GENERATION), timeout=min(left, 2.0))
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    if (await self._stub.ListModels(pb.ListModelsRequest(), timeout=min(left, 2.0))).models:
                        return
                    last = "no live node"
                else:
                    last = "not serving"
            except grpc.RpcError as e:
                last = e.code().name
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    async def list_models(self) -> list[pb.ModelInfo]:
        try:
            return list((await self._stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout)).models)
        except grpc.RpcError as e:
            raise PdserveError.from_rpc(e) from None

    def stream(
        self, prompt: str | None = None, prompt_token_ids=None, timeout: float | None = None, **sampling
    ) -> AsyncTokenStream:
        req = build_request(prompt, prompt_token_ids, **sampling)
        return AsyncTokenStream(self._stub.Generate(req, timeout=timeout or self.timeout))

    async def generate(
        self, prompt: str | None = None, prompt_token_ids=None, timeout: float | None = None, **sampling
    ) -> GenerateResult:
        res = GenerateResult()
        async with self.stream(prompt, prompt_token_ids, timeout=timeout, **sampling) as s:
            async for c in s:
                res.add(c)
        return res

    async def close(self) -> None:
        await self._chan.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
