"""AsyncClient's token streams: client/mux.py on the caller's event loop. One Generation.TokenStream
per router, read by a task that hands each request's deltas to that request's asyncio queue; the
same message order and the same guarantees as the blocking SDK's (docs/api.md, "Token streams")."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import grpc

from client.mux import ENDED, OwedTokens, StreamTable
from proto import pb


class AsyncRouterStream:
    """One router's token stream and the requests waiting on it (the loop's only)."""

    def __init__(self, stub, metadata: tuple) -> None:
        self.stream_id = uuid.uuid4().hex
        self._queues: dict[str, asyncio.Queue] = {}
        self.ended = False
        self.unsupported = False  # the router has no Generation.TokenStream (an older one)
        self._call = stub.TokenStream(pb.TokenStreamRequest(stream_id=self.stream_id), metadata=metadata)
        self._task = asyncio.get_running_loop().create_task(self._read())

    def register(self, request_id: str) -> asyncio.Queue | None:
        if self.ended or request_id in self._queues:
            return None
        q = self._queues[request_id] = asyncio.Queue()
        return q

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _read(self) -> None:
        try:
            async for batch in self._call:
                for d in batch.deltas:
                    q = self._queues.get(d.request_id)
                    if q is not None:
                        q.put_nowait(d)
        except grpc.RpcError as e:  # cancelled (the client closed) or the router went away: the calls say which
            self.unsupported = e.code() == grpc.StatusCode.UNIMPLEMENTED
        except asyncio.CancelledError:
            pass
        finally:
            self.ended = True
            for q in self._queues.values():
                q.put_nowait(ENDED)

    async def close(self) -> None:
        self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class AsyncTokenStreams(StreamTable):
    """An AsyncClient's token streams (its loop's only)."""

    def __init__(self, stubs: list, metadata: tuple) -> None:
        super().__init__(stubs, metadata, AsyncRouterStream)

    def stream(self, i: int) -> AsyncRouterStream | None:
        return self._current(i)

    async def close(self) -> None:
        for s in self._take_all():
            await s.close()


class AsyncMuxedCall:
    """client/mux.py's MuxedCall for grpc.aio: `async for` the call's first message, the request's
    deltas until its `last` one (or the stream's end), then the rest of the call."""

    def __init__(self, call, stream: AsyncRouterStream, request_id: str, q: asyncio.Queue) -> None:
        self._call, self._stream, self._rid, self._q = call, stream, request_id, q

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        try:
            it = self._call.__aiter__()
            try:
                first = await it.__anext__()
            except StopAsyncIteration:
                return
            yield first
            if first.token_stream and not first.finish_reason:
                got = 0  # tokens that came on the stream
                while (d := await self._q.get()) is not ENDED and not d.last:
                    got += len(d.token_ids)
                    yield d
                async for m in it:
                    if m.muxed_tokens > got:
                        self._call.cancel()
                        raise OwedTokens(m.muxed_tokens - got)
                    yield m
            else:
                async for m in it:
                    yield m
        finally:
            self._stream.unregister(self._rid)

    def cancel(self) -> None:
        self._call.cancel()
        self._q.put_nowait(ENDED)
