"""A prefill node's push into the decode node's reservation, once its first token is out: the task
that reads the rest of the Prefill stream (the transfer figures, or the failure it reports), which
the prefill phase (router/prefill.py) starts (docs/router.md, "Life of a request across the pools")."""

from __future__ import annotations

import asyncio
import logging

import grpc

from proto import pb
from router.migrate import watched
from router.registry import NodeEntry

log = logging.getLogger("pdserve.router")


class Push:
    """A prefill node's push into D's reservation, after it streamed the first token: a task
    reads the rest of the Prefill stream (the `pushed` message with the transfer figures, or the
    status of a failed push) while D already waits for the state and then decodes."""

    def __init__(self, p: NodeEntry, d: NodeEntry, rid: str, first: pb.PrefillResponse, call, on_fail, spawn, beat_s):
        self.p, self.d, self.rid, self.first, self.call, self.beat_s = p, d, rid, first, call, beat_s
        self.pushed: pb.Timings | None = None
        self.reserve_s = 0.0  # the handshake and the reservation on D, before P was called
        self.error: grpc.RpcError | None = None
        self.done = asyncio.Event()
        self._on_fail = on_fail
        if first.finish_reason:  # the first token ended the request: nothing is pushed
            self.done.set()
        else:
            spawn(self._watch())

    async def _watch(self) -> None:
        try:
            # read(), as for the first message; a P the heartbeats declare dead fails the push (NodeLost)
            while (m := await watched(self.p, self.call.read, self.call.cancel, self.beat_s)) is not grpc.aio.EOF:
                if m.pushed:
                    self.pushed = m.timings
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = e
                await self._on_fail(self, e)
        except asyncio.CancelledError:
            self.call.cancel()
            raise
        except Exception:  # a bug here must not go unseen: D's lease frees the reservation
            log.exception("request %s: reading the push from %s failed", self.rid, self.p.node_id)
        finally:
            self.done.set()

    async def wait(self, timeout_s: float) -> bool:
        """True once the push has ended (pushed, failed or cancelled), waiting at most timeout_s."""
        if not self.done.is_set() and timeout_s > 0:
            try:
                await asyncio.wait_for(self.done.wait(), timeout_s)
            except TimeoutError:
                pass
        return self.done.is_set()

    def timings(self) -> pb.Timings:
        """prefill_s from the first message; transfer_s and bytes once pushed."""
        t = pb.Timings(prefill_s=self.first.timings.prefill_s)
        if self.pushed is not None:
            t.transfer_s, t.transfer_bytes = self.pushed.transfer_s, self.pushed.transfer_bytes
        return t
