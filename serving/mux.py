"""A decode node's token streams (DecodeNode.TokenStream): one per caller that opened one, carrying
the tokens of every request that named it, one batch per engine step. The engine loop thread adds
each muxed output's tokens to its stream's batch and flushes the batch after the step; the stream's
handler thread wakes once per step and sends the batch as one message. Which outputs of a request go
on the stream and which on its own call: RequestHandle.deliver (serving/commands.py)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Delta:
    """One request's new tokens of one step (logprobs: the engine's tuples, or None)."""

    request_id: str
    token_ids: list[int]
    logprobs: list | None


class TokenSink:
    """One token stream's batch being built (loop thread) and the batches ready to send (its
    handler thread). Closing sends what was added first; what is added after is dropped: the
    caller treats a call still owed tokens after the stream's end as the node's failure."""

    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id
        self.closed = False
        self._lock = threading.Lock()  # a close between a step's adds and its flush sends them first
        self._batch: list[Delta] = []
        self._ready: queue.SimpleQueue[list[Delta] | None] = queue.SimpleQueue()

    # loop thread
    def add(self, request_id: str, token_ids: list[int], logprobs: list | None) -> None:
        with self._lock:
            if not self.closed:
                self._batch.append(Delta(request_id, token_ids, logprobs))

    def flush(self) -> None:
        """The step is over: its batch goes out as one message."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        if self._batch:
            self._ready.put(self._batch)
            self._batch = []

    # any thread
    def close(self) -> None:
        """Ends the stream after what was added so far (the tokens a request's count includes)."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self._flush()
                self._ready.put(None)

    # the stream's handler thread
    def batches(self) -> Iterator[list[Delta]]:
        """The batches as the steps flush them, until closed."""
        while True:
            b = self._ready.get()
            if b is None:
                return
            yield b


class TokenSinks:
    """The node's open token streams by id (handler threads open, look up and close them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sinks: dict[str, TokenSink] = {}

    def open(self, stream_id: str) -> TokenSink:
        """A new stream under this id; one already open under it is closed (the caller reopened)."""
        sink = TokenSink(stream_id)
        with self._lock:
            old, self._sinks[stream_id] = self._sinks.get(stream_id), sink
        if old is not None:
            old.close()
        return sink

    def get(self, stream_id: str) -> TokenSink | None:
        if not stream_id:
            return None
        with self._lock:
            sink = self._sinks.get(stream_id)
        return None if sink is None or sink.closed else sink

    def close(self, sink: TokenSink) -> None:
        sink.close()
        with self._lock:
            if self._sinks.get(sink.stream_id) is sink:
                del self._sinks[sink.stream_id]

    def close_all(self) -> None:
        """The node stops: every stream ends now (its handler returns) rather than at the server's grace."""
        with self._lock:
            sinks, self._sinks = list(self._sinks.values()), {}
        for sink in sinks:
            sink.close()
