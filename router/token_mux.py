"""The router's token streams (docs/router.md, "Token streams"): one DecodeNode.TokenStream per
decode node, opened on first use, carrying the tokens of every request the router streams from
that node as one message per engine step, and demultiplexed here by request id into each request's
inbox. `merged` puts a request's Generate call and its deltas back into one ordered stream: the
call's first message, the deltas, then the call's later messages once the deltas they count
(GenerateResponse.muxed_tokens) are in. A token stream that breaks fails every request on it as
its node's failure: they move (router/migrate.py) with the tokens relayed."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from proto import pb
from router.migrate import NodeLost

log = logging.getLogger("pdserve.router")


class StreamBroken(NodeLost):
    """The node's token stream ended while requests were on it: their node failed (UNAVAILABLE).
    `clean`: the node ended it itself (it stops): each request's own call then ends with its
    node's word (a drain's hand-off, say), and only a call still owed tokens fails with this."""

    def __init__(self, node_id: str, why: str, clean: bool = False) -> None:
        super().__init__(node_id, f"lost its token stream ({why})")
        self.clean = clean


@dataclass
class MuxTotals:
    """Since the router started, over every node's token stream (the router's metrics)."""

    messages: int = 0  # TokenBatch messages read
    tokens: int = 0  # tokens in them
    broken: int = 0  # streams that broke with requests on them


@dataclass(frozen=True, slots=True)
class _Ended:
    """The Generate call ended: normally (error None) or with this error."""

    error: BaseException | None = None


Item = pb.TokenDelta | pb.GenerateResponse | _Ended | StreamBroken


@dataclass(frozen=True, slots=True)
class Route:
    """One request on a token stream: where its deltas go until `close()`."""

    mux: TokenMux
    request_id: str
    stream_id: str
    inbox: asyncio.Queue[Item]

    def close(self) -> None:
        self.mux.unroute(self)


class TokenMux:
    """One decode node's token stream for this router. `route` names it for a request (opening it
    when none is open) and sends the request's deltas to an inbox; a node without TokenStream
    (UNIMPLEMENTED) is not asked again and its requests stream on their own calls."""

    def __init__(self, node_id: str, stub: Callable[[], Any], totals: MuxTotals | None = None) -> None:
        self.node_id = node_id
        self._stub = stub
        self.totals = totals if totals is not None else MuxTotals()
        self.stream_id = ""
        self.unsupported = False
        self._routes: dict[str, asyncio.Queue[Item]] = {}
        self._task: asyncio.Task[None] | None = None

    def route(self, request_id: str) -> Route | None:
        """A route for this request's deltas (its stream_id goes in DecodeRequest.token_stream),
        opening the stream when none is open; None when the node has no token stream."""
        if self.unsupported:
            return None
        if self._task is None:
            self.stream_id = uuid.uuid4().hex
            self._task = asyncio.get_running_loop().create_task(self._read(self.stream_id))
        r = Route(self, request_id, self.stream_id, asyncio.Queue())
        self._routes[request_id] = r.inbox
        return r

    def unroute(self, r: Route) -> None:
        if self._routes.get(r.request_id) is r.inbox:
            del self._routes[r.request_id]

    @property
    def routed(self) -> int:
        return len(self._routes)

    async def _read(self, stream_id: str) -> None:
        why, clean = "it ended", True
        try:
            call = self._stub().TokenStream(pb.TokenStreamRequest(stream_id=stream_id))
            totals = self.totals
            async for batch in call:
                routes = self._routes
                totals.messages += 1
                for d in batch.deltas:
                    totals.tokens += len(d.token_ids)
                    inbox = routes.get(d.request_id)
                    if inbox is not None:
                        inbox.put_nowait(d)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("decode node %s has no token stream: its requests stream on their own calls", self.node_id)
                self.unsupported = True
            why, clean = f"{e.code().name}: {e.details()}", False
        except asyncio.CancelledError:
            why, clean = "cancelled", False
            raise
        finally:
            self._task = None
            routes, self._routes = self._routes, {}
            if not self.unsupported:
                if routes and clean:  # the node stops (a drain's end): each request ends with its own call
                    n = len(routes)
                    log.info("decode node %s: token stream ended with %d requests on it", self.node_id, n)
                elif routes:
                    self.totals.broken += 1
                    n = len(routes)
                    log.warning("decode node %s: token stream broke (%s) with %d requests on it", self.node_id, why, n)
                for inbox in routes.values():
                    inbox.put_nowait(StreamBroken(self.node_id, why, clean))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


async def _pump(call: Any, inbox: asyncio.Queue[Item]) -> None:
    try:
        async for m in call:
            inbox.put_nowait(m)
    except BaseException as e:  # an RpcError, or CancelledError: the call was cancelled (NodeWatch)
        inbox.put_nowait(_Ended(e))
        if isinstance(e, asyncio.CancelledError):
            raise
        return
    inbox.put_nowait(_Ended())


async def merged(call: Any, route: Route | None) -> AsyncIterator[pb.GenerateResponse]:
    """The messages of a decode node's Generate `call` in order, with the token stream's deltas of
    its request (as GenerateResponse) between its first message and the later ones; without a
    route, the call's own messages. A call error raises once the messages before it are relayed;
    a cancelled call (its node declared dead) or a broken stream raises at once; a stream its node
    ended cleanly (it stops) raises only for a call message whose tokens it no longer can bring."""
    if route is None:
        async for m in call:
            yield m
        return
    inbox = route.inbox
    pump = asyncio.get_running_loop().create_task(_pump(call, inbox))
    early: list[pb.TokenDelta] = []  # deltas ahead of the call's first message
    calls: deque[pb.GenerateResponse | _Ended] = deque()  # the call's messages waiting for deltas
    started = False
    got = 0  # this request's tokens relayed from the stream
    timings = pb.Timings()  # the node's, from its first message
    closed: StreamBroken | None = None  # the node ended the stream cleanly: no more deltas
    try:
        while True:
            item = await inbox.get()
            if isinstance(item, StreamBroken):
                if not item.clean:
                    raise item
                closed = item
            if isinstance(item, _Ended) and isinstance(item.error, asyncio.CancelledError):
                raise item.error
            if isinstance(item, pb.TokenDelta):
                if not started:
                    early.append(item)
                    continue
                got += len(item.token_ids)
                yield pb.GenerateResponse(token_ids=item.token_ids, logprobs=item.logprobs, timings=timings)
            elif not isinstance(item, StreamBroken):
                calls.append(item)
            while calls and (isinstance(calls[0], _Ended) or got >= calls[0].muxed_tokens):
                m = calls.popleft()
                if isinstance(m, _Ended):
                    if m.error is not None:
                        raise m.error
                    return
                if started and not m.token_ids and not m.finish_reason:
                    continue  # a count only (the drain's hand-off): nothing to relay
                yield m
                if not started:
                    started, timings = True, m.timings
                    for d in early:
                        got += len(d.token_ids)
                        yield pb.GenerateResponse(token_ids=d.token_ids, logprobs=d.logprobs, timings=timings)
                    early = []
            if closed is not None and calls and not isinstance(calls[0], _Ended):
                raise closed  # owed tokens the ended stream cannot bring
    finally:
        route.close()
        pump.cancel()
