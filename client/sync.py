"""Client: the blocking SDK (one gRPC channel to a router)."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.types import GenerateResult, PdserveError, StreamChunk, Failover, addresses, build_request, chunk_from
from proto import pb, rpc

GENERATION = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class TokenStream:
    """Iterate for StreamChunks; close() (or the end of a `with` block) cancels the request.

    `start(i)` makes the call on router i; with several routers, a call that fails UNAVAILABLE
    before its first chunk is made again on the next router (each router once)."""

    def __init__(self, start, first: int = 0, routers: int = 1, on_switch=None):
        self._routes = Failover(start, first, routers, on_switch)
        self.closed = False

    @property
    def _call(self):
        return self._routes.call

    def __iter__(self):
        yielded = False
        while True:
            try:
                for m in self._call:
                    yielded = True
                    yield chunk_from(m)
                return
            except grpc.RpcError as e:
                if self.closed and e.code() == grpc.StatusCode.CANCELLED:
                    return
                if self._routes.retry(e, yielded, self.closed):
                    continue
                raise PdserveError.from_rpc(e) from None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._call.cancel()

    cancel = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Client:
    def __init__(self, addr, timeout: float | None = None):
        """addr: the router's host:port, or several routers of the same pools ("a:1,b:2" or a list),
        tried in turn. timeout: default deadline of every call (seconds)."""
        self.addrs = addresses(addr)
        self.timeout = timeout
        self._chans = [grpc.insecure_channel(a) for a in self.addrs]
        self._stubs = [rpc.GenerationStub(c) for c in self._chans]
        self._healths = [health_pb2_grpc.HealthStub(c) for c in self._chans]
        self._cur = 0  # the router calls go to first

    @property
    def addr(self) -> str:
        return self.addrs[self._cur]

    def _use(self, i: int) -> None:
        self._cur = i % len(self.addrs)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until a router serves and knows at least one live model (node); TimeoutError after."""
        deadline = time.monotonic() + timeout
        last: dict[str, str] = {}
        while True:
            for i in range(len(self.addrs)):
                left = deadline - time.monotonic()
                if left <= 0:
                    why = ", ".join(f"{a}: {last.get(a, 'not reachable')}" for a in self.addrs)
                    raise TimeoutError(f"no router ready after {timeout:g} s ({why})")
                try:
                    r = self._healths[i].Check(health_pb2.HealthCheckRequest(service=GENERATION),
                                               timeout=min(left, 2.0))  # fmt: skip
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        if self._stubs[i].ListModels(pb.ListModelsRequest(), timeout=min(left, 2.0)).models:
                            self._use(i)
                            return
                        last[self.addrs[i]] = "no live node"
                    else:
                        last[self.addrs[i]] = "not serving"
                except grpc.RpcError as e:
                    last[self.addrs[i]] = e.code().name
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def list_models(self) -> list[pb.ModelInfo]:
        try:
            return list(self._stubs[self._cur].ListModels(pb.ListModelsRequest(), timeout=self.timeout).models)
        except grpc.RpcError as e:
            raise PdserveError.from_rpc(e) from None

    def stream(
        self, prompt: str | None = None, prompt_token_ids=None, timeout: float | None = None, **sampling
    ) -> TokenStream:
        """Chunks as the tokens come. Options: max_tokens, temperature, top_k, top_p, seed,
        stop_token_ids, ignore_eos, request_id."""
        req = build_request(prompt, prompt_token_ids, **sampling)
        n = len(self.addrs)
        return TokenStream(lambda i: self._stubs[i % n].Generate(req, timeout=timeout or self.timeout),
                           self._cur, n, self._use)  # fmt: skip

    def generate(
        self, prompt: str | None = None, prompt_token_ids=None, timeout: float | None = None, **sampling
    ) -> GenerateResult:
        res = GenerateResult()
        with self.stream(prompt, prompt_token_ids, timeout=timeout, **sampling) as s:
            for c in s:
                res.add(c)
        return res

    def close(self) -> None:
        for c in self._chans:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["Client", "StreamChunk", "TokenStream"]
