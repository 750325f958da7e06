"""The blocking SDK's token streams (docs/api.md, "Token streams"): one Generation.TokenStream per
router a Client streams from, opened on first use and read by a thread of its own, which hands each
request's chunks to that request's queue. A Generate call that names the stream gets its first and
last messages on the call and the chunks between on the stream, batched with the client's other
requests: one message per engine step for all of them instead of one per request."""

from __future__ import annotations

import threading
import uuid
from queue import SimpleQueue

import grpc

from proto import pb

ENDED = None  # put in every waiting request's queue when the stream ends: read the rest of the call


class RouterStream:
    """One router's token stream and the requests waiting on it."""

    def __init__(self, stub, metadata: tuple) -> None:
        self.stream_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._queues: dict[str, SimpleQueue] = {}
        self.ended = False
        self.unsupported = False  # the router has no Generation.TokenStream (an older one)
        self._call = stub.TokenStream(pb.TokenStreamRequest(stream_id=self.stream_id), metadata=metadata)
        threading.Thread(target=self._read, name="pdserve-token-stream", daemon=True).start()

    def register(self, request_id: str) -> SimpleQueue | None:
        """The queue of a request about to start; None when the stream ended or the id is in use."""
        with self._lock:
            if self.ended or request_id in self._queues:
                return None
            q = self._queues[request_id] = SimpleQueue()
            return q

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)

    def _read(self) -> None:
        try:
            for batch in self._call:
                with self._lock:
                    for d in batch.deltas:
                        q = self._queues.get(d.request_id)
                        if q is not None:
                            q.put(d)
        except grpc.RpcError as e:  # cancelled (the client closed) or the router went away: the calls say which
            self.unsupported = e.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            with self._lock:
                self.ended = True
                waiting = list(self._queues.values())
            for q in waiting:
                q.put(ENDED)

    def close(self) -> None:
        self._call.cancel()


class StreamTable:
    """One token stream per router, opened on first use and again after one ended; none for a
    router without the RPC. `make(stub, metadata)` opens one (RouterStream or its asyncio twin)."""

    def __init__(self, stubs: list, metadata: tuple, make) -> None:
        self._stubs, self._md, self._make = stubs, metadata, make
        self._open: dict = {}
        self.closed = False

    def _current(self, i: int):
        if self.closed:
            return None
        s = self._open.get(i)
        if s is not None and s.unsupported:
            return None  # every chunk on its call
        if s is None or s.ended:
            s = self._open[i] = self._make(self._stubs[i], self._md)
        return s

    def _take_all(self) -> list:
        self.closed = True
        streams, self._open = list(self._open.values()), {}
        return streams


class TokenStreams(StreamTable):
    """A Client's token streams (any thread may ask for one)."""

    def __init__(self, stubs: list, metadata: tuple) -> None:
        super().__init__(stubs, metadata, RouterStream)
        self._lock = threading.Lock()

    def stream(self, i: int) -> RouterStream | None:
        """Router i's stream (None once the client closed, or where the router has none)."""
        with self._lock:
            return self._current(i)

    def close(self) -> None:
        with self._lock:
            streams = self._take_all()
        for s in streams:
            s.close()


class OwedTokens(grpc.RpcError):
    """The token stream ended before it brought the tokens a call's message counts: the request is
    made again (client/routers.py) from the tokens received, as after a router's failure."""

    def __init__(self, owed: int) -> None:
        super().__init__(f"the router's token stream ended {owed} tokens short")
        self._details = str(self.args[0])

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return ()


class MuxedCall:
    """A Generate call that named a token stream, iterated as one stream of messages in order:
    the call's first message, the request's deltas from the stream until its `last` delta (or
    the stream's end), then the rest of the call. cancel() cancels the call and wakes the reader."""

    def __init__(self, call, stream: RouterStream, request_id: str, q: SimpleQueue) -> None:
        self._call, self._stream, self._rid, self._q = call, stream, request_id, q

    def __iter__(self):
        try:
            it = iter(self._call)
            first = next(it, None)
            if first is None:
                return
            yield first
            if not first.token_stream or first.finish_reason:
                yield from it
                return
            got = 0  # tokens that came on the stream
            while (d := self._q.get()) is not ENDED and not d.last:
                got += len(d.token_ids)
                yield d
            for m in it:
                if m.muxed_tokens > got:
                    self._call.cancel()
                    raise OwedTokens(m.muxed_tokens - got)
                yield m
        finally:
            self._stream.unregister(self._rid)

    def cancel(self) -> None:
        self._call.cancel()
        self._q.put(ENDED)
