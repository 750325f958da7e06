"""The router's gRPC services on `grpc.aio`: `Generation` for clients (each Generate call is one
`GenerateService.generate`, its chunks as GenerateResponse messages) and `Registry` for nodes
(Register, Heartbeat) and operators (ListNodes).

A client that cancels its call cancels the servicer's task: the request's generator unwinds and
cancels its calls to the nodes (router/request.py). Errors end the call with their status code
and message; a draining router adds the `pdserve-draining` trailing metadata, a refusal at
admission `pdserve-retry-after-s` (its estimated wait in seconds, rounded up to the millisecond so
that it never reads as within the budget it exceeded).
"""

from __future__ import annotations

import math
from contextlib import aclosing

import grpc

from proto import pb, rpc
from router.client_hints import HINTS, from_metadata
from router.errors import Abort, Draining
from router.request import Chunk
from serving.rpc import DRAINING_KEY

RETRY_AFTER_KEY = "pdserve-retry-after-s"  # trailing metadata of a refusal at arrival: the estimated wait


def response(c: Chunk) -> pb.GenerateResponse:
    m = pb.GenerateResponse(
        request_id=c.request_id,
        token_ids=c.token_ids,
        text=c.text,
        finish_reason=c.finish_reason,
        logprobs=c.logprobs,
        prompt_logprobs=c.prompt_logprobs,
        timings=c.timings,
    )
    if c.first:
        m.prompt_tokens, m.decode_node, m.prefill_node = c.prompt_tokens, c.decode_node, c.prefill_node
        m.cached_tokens = c.cached_tokens
    return m


class GenerationApi(rpc.GenerationServicer):
    def __init__(self, service):
        self.service = service

    async def Generate(self, request, context):
        HINTS.set(from_metadata(context.invocation_metadata() or (), self.service.creds))
        try:
            async with aclosing(self.service.generate(request)) as chunks:
                async for c in chunks:
                    yield response(c)
        except Abort as a:
            if isinstance(a, Draining):
                context.set_trailing_metadata(((DRAINING_KEY, "1"),))
            elif a.retry_after_s is not None:
                context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{math.ceil(a.retry_after_s * 1000) / 1000:.3f}"),))
            await context.abort(a.code, a.msg)

    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=self.service.models())


class RegistryApi(rpc.RegistryServicer):
    def __init__(self, service):
        self.service, self.registry = service, service.registry

    async def Register(self, request, context):
        if not request.node.node_id or not request.node.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node_id and address are required")
        self.registry.register(request.node)
        self.service.prefill.warm_pairs()  # its transfer handshakes before its first request
        return pb.RegisterResponse(heartbeat_interval_s=self.service.cfg.heartbeat_interval_s)

    async def Heartbeat(self, request, context):
        known = self.registry.heartbeat(
            request.node_id,
            request.incarnation,
            request.capacity,
            request.draining,
            request.prefix if request.HasField("prefix") else None,
            request.prefill_tokens_per_s,
        )
        e = self.registry.nodes.get(request.node_id) if known else None
        pool = e is not None and e.info.kind == pb.NODE_KIND_DECODE and bool(self.service.prefill.ready(e, set()))
        return pb.HeartbeatResponse(known=known, prefill_pool=pool)

    async def ListNodes(self, request, context):
        return pb.ListNodesResponse(
            nodes=[
                pb.NodeStatus(node=e.info, alive=e.alive, last_seen_s=age, static=e.static)
                for e, age in self.registry.snapshot()
            ]
        )


def add_services(server: grpc.aio.Server, service) -> None:
    rpc.add_GenerationServicer_to_server(GenerationApi(service), server)
    rpc.add_RegistryServicer_to_server(RegistryApi(service), server)
