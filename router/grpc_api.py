"""The router's gRPC services on `grpc.aio`: `Generation` for clients (each Generate call is one
`GenerateService.generate`, its chunks as GenerateResponse messages, the middle ones on the
client's token stream when the call names one: router/client_streams.py; Chat: router/grpc_chat.py)
and `Registry` for nodes
(Register, Heartbeat) and operators (ListNodes).

A client that cancels its call cancels the servicer's task: the request's generator unwinds and
cancels its calls to the nodes (router/request.py). Errors end the call with their status code
and message; a draining router adds the `pdserve-draining` trailing metadata, a refusal at
admission `pdserve-retry-after-s` (its estimated wait in seconds, rounded up to the millisecond so
that it never reads as within the budget it exceeded).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import grpc

from proto import pb, rpc
from router.client_hints import HINTS, from_metadata
from router.errors import Abort, Draining
from router.request import Chunk
from serving.rpc import DRAINING_KEY, MAX_REQUEST_ID_LEN

RETRY_AFTER_KEY = "pdserve-retry-after-s"  # trailing metadata of a refusal at arrival: the estimated wait


def delta(c: Chunk) -> pb.TokenDelta:
    """A middle chunk as its token stream carries it (no timings: the last message has them)."""
    return pb.TokenDelta(request_id=c.request_id, token_ids=c.token_ids, logprobs=c.logprobs, text=c.text)


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
    def __init__(self, service, front: Callable[[], Any]):
        self.service = service
        self.front = front  # the router's OpenAIFront, made on first use (Chat; router/server.py)

    @staticmethod
    async def _abort(a: Abort, context) -> None:
        if isinstance(a, Draining):
            context.set_trailing_metadata(((DRAINING_KEY, "1"),))
        elif a.retry_after_s is not None:
            context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{math.ceil(a.retry_after_s * 1000) / 1000:.3f}"),))
        await context.abort(a.code, a.msg)

    async def Generate(self, request, context):
        HINTS.set(from_metadata(context.invocation_metadata() or (), self.service.creds))
        stream = self.service.client_streams.get(context.peer(), request.token_stream)
        muxed = 0  # tokens of this call put on its token stream
        first, rid = True, ""
        try:
            async with aclosing(self.service.generate(request)) as chunks:
                async for c in chunks:
                    if stream is not None and not first and not c.finish_reason:
                        if stream.add(delta(c)):
                            muxed += len(c.token_ids)
                            continue
                        stream = None  # it closed: the rest comes on this call
                    m = response(c)
                    m.muxed_tokens, m.token_stream, first = muxed, first and stream is not None, False
                    rid = m.request_id
                    yield m
        except Abort as a:
            await self._abort(a, context)
        finally:
            if stream is not None and not first:  # the client reads the rest of this call
                stream.add(pb.TokenDelta(request_id=rid, last=True))

    async def Chat(self, request, context):
        """An OpenAI chat body (router/grpc_chat.py; imported here: the HTTP stack it shares loads
        only once a router serves chat)."""
        from router.grpc_chat import GRPC_OF, chat_chunks
        from router.openai_models import ApiError

        HINTS.set(from_metadata(context.invocation_metadata() or (), self.service.creds))
        try:
            async with aclosing(chat_chunks(self.front(), request.body_json, request.resume)) as chunks:
                async for m in chunks:
                    yield m
        except ApiError as e:
            await context.abort(GRPC_OF.get(e.status, grpc.StatusCode.INTERNAL), e.message)
        except Abort as a:
            await self._abort(a, context)

    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=self.service.models())

    async def TokenStream(self, request, context):
        """A client's token stream (router/client_streams.py), open until the client cancels it
        or the router stops."""
        if not request.stream_id or len(request.stream_id) > MAX_REQUEST_ID_LEN:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"stream_id must be 1 to {MAX_REQUEST_ID_LEN} characters"
            )
        streams = self.service.client_streams
        s = streams.open(context.peer(), request.stream_id)
        try:
            async for b in s.batches():
                yield b
        finally:
            streams.close(s)


class RegistryApi(rpc.RegistryServicer):
    def __init__(self, service):
        self.service, self.registry = service, service.registry

    async def Register(self, request, context):
        if not request.node.node_id or not request.node.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node_id and address are required")
        if (holder := self.registry.taken(request.node)) is not None:  # two nodes under one id: refuse the second
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"node id {request.node.node_id!r} is taken by a live node at {holder.info.address}: "
                "give this node its own --node-id",
            )
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
            request.requests_ended,
            request.prefill_cost if request.HasField("prefill_cost") else None,
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


def add_services(server: grpc.aio.Server, service, front: Callable[[], Any]) -> None:
    rpc.add_GenerationServicer_to_server(GenerationApi(service, front), server)
    rpc.add_RegistryServicer_to_server(RegistryApi(service), server)
