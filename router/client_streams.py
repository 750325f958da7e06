"""Clients' token streams on the router (Generation.TokenStream, docs/api.md "Token streams"): one
per client connection that opened one, carrying the middle chunks of every Generate call that
names it, batched: the chunks added while the loop handles one engine step's tokens go out as one
message. A Generate call sends its first and last messages (and errors) itself; its last message's
`muxed_tokens` counts the tokens it put on the stream, so the client relays the last message only
once it has them. A stream that closes takes no more chunks: a call then sends the rest itself."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from proto import pb


class ClientStream:
    """One client's token stream: the batch being built and the batches ready to send."""

    def __init__(self, key: tuple[str, str], totals: ClientStreams) -> None:
        self.key = key  # (peer, id) in ClientStreams
        self._totals = totals
        self.closed = False
        self._batch: list[pb.TokenDelta] = []
        self._ready: asyncio.Queue[list[pb.TokenDelta] | None] = asyncio.Queue()
        self._flush_due = False

    def add(self, delta: pb.TokenDelta) -> bool:
        """Queue one call's chunk; False when the stream is closed (the call sends it itself). The
        batch goes out once the loop has run every callback ready now: the other requests woken by
        the same engine step add theirs first."""
        if self.closed:
            return False
        self._batch.append(delta)
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)
        return True

    def _flush(self) -> None:
        self._flush_due = False
        if self._batch:
            self._ready.put_nowait(self._batch)
            self._batch = []

    def close(self) -> None:
        """Ends the stream after what was added (the tokens the calls' counts include)."""
        if not self.closed:
            self.closed = True
            self._flush()
            self._ready.put_nowait(None)

    async def batches(self) -> AsyncIterator[pb.TokenBatch]:
        while (b := await self._ready.get()) is not None:
            self._totals.messages += 1
            self._totals.deltas += len(b)
            yield pb.TokenBatch(deltas=b)


class ClientStreams:
    """The router's open client token streams, by (peer, id): only calls on the connection that
    opened a stream can use or replace it, so no client can name another's and read its tokens."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, str], ClientStream] = {}
        self.messages = 0  # batches sent on all streams so far
        self.deltas = 0  # chunks they carried

    def open(self, peer: str, stream_id: str) -> ClientStream:
        """A new stream under this id; one already open under it ends (the client reopened it)."""
        s = ClientStream((peer, stream_id), self)
        old, self._open[s.key] = self._open.get(s.key), s
        if old is not None:
            old.close()
        return s

    def get(self, peer: str, stream_id: str) -> ClientStream | None:
        s = self._open.get((peer, stream_id)) if stream_id else None
        return None if s is None or s.closed else s

    def close(self, s: ClientStream) -> None:
        s.close()
        if self._open.get(s.key) is s:
            del self._open[s.key]

    def close_all(self) -> None:
        """The router stops: every stream ends now rather than at the server's grace."""
        streams, self._open = list(self._open.values()), {}
        for s in streams:
            s.close()

    def __len__(self) -> int:
        return len(self._open)
