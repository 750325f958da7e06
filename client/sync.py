"""Client: the blocking SDK (one gRPC channel to a router)."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.types import GenerateResult, PdserveError, StreamChunk, build_request, chunk_from
from proto import pb, rpc

GENERATION = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class TokenStream:
    """Iterate for StreamChunks; close() (or the end of a `with` block) cancels the request."""

    def __init__(self, call):
        self._call = call
        self.closed = False

    def __iter__(self):
        try:
            for m in self._call:
                yield chunk_from(m)
        except grpc.RpcError as e:
            if self.closed and e.code() == grpc.StatusCode.CANCELLED:
                return
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
    def __init__(self, addr: str, timeout: float | None = None):
        """addr: the router's host:port. timeout: default deadline of every call (seconds)."""
        self.addr = addr
        self.timeout = timeout
        self._chan = grpc.insecure_channel(addr)
        self._stub = rpc.GenerationStub(self._chan)
        self._health = health_pb2_grpc.HealthStub(self._chan)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the router serves and knows at least one live model (node); TimeoutError after."""
        deadline = time.monotonic() + timeout
        last = "not reachable"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"router {self.addr} not ready after {timeout:g} s ({last})")
            try:
                r = self._health.Check(health_pb2.HealthCheckRequest(service=GENERATION), timeout=min(left, 2.0))
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    if self._stub.ListModels(pb.ListModelsRequest(), timeout=min(left, 2.0)).models:
                        return
                    last = "no live node"
                else:
                    last = "not serving"
            except grpc.RpcError as e:
                last = e.code().name
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def list_models(self) -> list[pb.ModelInfo]:
        try:
            return list(self._stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout).models)
        except grpc.RpcError as e:
            raise PdserveError.from_rpc(e) from None

    def stream(
        self, prompt: str | None = None, prompt_token_ids=None, timeout: float | None = None, **sampling
    ) -> TokenStream:
        """Chunks as the tokens come. Options: max_tokens, temperature, top_k, top_p, seed,
        stop_token_ids, ignore_eos, request_id."""
        req = build_request(prompt, prompt_token_ids, **sampling)
        return TokenStream(self._stub.Generate(req, timeout=timeout or self.timeout))

    def generate(
        self, prompt: str | None = None, prompt_token_ids=None, timeout: float | None = None, **sampling
    ) -> GenerateResult:
        res = GenerateResult()
        with self.stream(prompt, prompt_token_ids, timeout=timeout, **sampling) as s:
            for c in s:
                res.add(c)
        return res

    def close(self) -> None:
        self._chan.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["Client", "StreamChunk", "TokenStream"]
