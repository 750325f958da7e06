"""Who waits on the engine's transfers, for the engine loop (serving/loop.py, its thread only): a
prefilled request's handle until its push ends, AwaitTransfer futures until a reservation is ready
or failing, Release futures until the memory is back. `settle` hands a poll's records to them;
`fail` ends every wait when the loop stops."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

from engine.connector import RecvFreed, SendDone, TransferRecord
from serving.commands import RequestHandle, refuse, settle


class TransferWaits:
    def __init__(self) -> None:
        self.pushing: dict[str, RequestHandle] = {}  # prefilled requests whose push runs
        self.awaiting: dict[str, list[Future[TransferRecord]]] = {}  # AwaitTransfer, by request
        self.releasing: dict[str, list[Future[None]]] = {}  # Release waiting for the memory

    def settle(self, records: Sequence[TransferRecord]) -> None:
        """A poll's records to whoever waits for them."""
        for r in records:
            rid = r.request_id
            if isinstance(r, SendDone):
                h = self.pushing.pop(rid, None)
                if h is not None:
                    h._transfer_ended(r)
            for fut in self.awaiting.pop(rid, []):
                settle(fut, r)
            if isinstance(r, (SendDone, RecvFreed)):
                for done in self.releasing.pop(rid, []):
                    settle(done, None)

    def fail(self, err: Exception) -> None:
        """The loop stops: nobody waits on a transfer any more."""
        for h in self.pushing.values():
            h._transfer_ended(None, err)
        for waits in self.awaiting.values():
            for fut in waits:
                refuse(fut, err)
        for dones in self.releasing.values():
            for done in dones:
                refuse(done, err)
        self.pushing, self.awaiting, self.releasing = {}, {}, {}
