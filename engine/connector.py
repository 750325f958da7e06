"""The engine's interface to a state transfer: the `Connector` an EngineCore calls on its own thread
at each point of a request's life (added, rows scheduled, chunk computed, prefilled, reserved,
activating, finished, aborted), and the typed records its `poll()` returns (SendDone, RecvReady,
RecvFailed, RecvFreed); and its worker side, the `LayerConnector` each rank's forward calls after
every decoder layer of a step that hands a request's state over layer by layer. The engine owns
both; transfer/ implements them. It never frees engine memory: the engine does on SendDone /
RecvFreed. Call points: docs/engine.md, "The connector"."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.devices import DeviceMark
    from engine.request import Request
    from engine.scheduler import SchedulerOutput


# ---- what poll() reports ---------------------------------------------------------------------
@dataclass(frozen=True)
class SendDone:
    """Prefill side: a push ended and no write can still read its source pages; the engine
    releases the HELD memory on seeing it."""

    request_id: str
    error: str | None = None  # None: the whole state is in the destination's reservation
    aborted: bool = False  # ended by an abort (the caller, the router), not by a failure
    nbytes: int = 0  # bytes written, all ranks
    seconds: float = 0.0  # from the writes being posted to the end


@dataclass(frozen=True)
class RecvReady:
    """Decode side: every rank holds the whole transferred state; `activate` may take it."""

    request_id: str


@dataclass(frozen=True)
class RecvFailed:
    """Decode side: the reservation failed (transfer error, lease run out, released); its memory
    is freed once no write can land (a RecvFreed follows)."""

    request_id: str
    error: str
    expired: bool = False  # its lease ran out


@dataclass(frozen=True)
class RecvFreed:
    """Decode side: a failed reservation's memory can go back; the engine frees it on seeing it."""

    request_id: str


TransferRecord = SendDone | RecvReady | RecvFailed | RecvFreed


@dataclass(frozen=True)
class ConnectorStats:
    """Running totals since start, and what is in flight now."""

    in_flight: int = 0  # pushes or reservations the connector tracks
    sends_done: int = 0
    sends_failed: int = 0
    bytes_sent: int = 0
    receives_ready: int = 0
    receives_failed: int = 0
    lease_renewals: int = 0  # decode side: reservation leases a prefill node restarted
    lease_expiries: int = 0  # decode side: reservations failed because their lease ran out


# ---- the interface ---------------------------------------------------------------------------
class Connector(ABC):
    """What an EngineCore calls on its own thread; see the module docstring for when."""

    # -- scheduler side (request life) --
    def request_added(self, request: Request) -> None:
        """A request was queued (its `kv_transfer` holds the caller's transfer parameters)."""
        return None  # by default: nothing to do

    def request_resumed(self, request: Request) -> None:
        """A request was queued again with output tokens it already has (mid-stream failover:
        another node produced them); the engine recomputes prompt + those tokens, then decodes on.
        A connector may fetch the state instead, once it can."""
        return None  # by default: nothing to do

    def rows_scheduled(self, so: SchedulerOutput) -> Collection[str]:
        """The step's rows are scheduled and about to run (a prefill side opens the push of a
        request whose last prompt chunk is among them). Returns the requests whose state every
        rank hands its `LayerConnector` layer by layer during this step's forward."""
        return ()  # by default: nothing to do, no layer-by-layer hand-over

    def prefill_chunk_done(self, request: Request, start: int, end: int) -> None:
        """Prompt positions [start, end) of a request are computed and in its pages (called for
        every chunk, the last one too, before `prompt_prefilled`): where a long context's pages
        can go out while later chunks compute."""
        return None  # by default: nothing to do

    def prompt_prefilled(self, request: Request) -> None:
        """A prefill-only request is HELD: its prompt's state and first token exist."""
        return None  # by default: nothing to do

    def request_reserved(self, request: Request) -> object:
        """A request is RESERVED (decode side); the answer goes back to the caller of reserve
        (e.g. where the writer should write). Raising gives the memory back and fails reserve."""
        return None

    def request_activating(self, request: Request) -> None:
        """A RESERVED request is about to join the batch: take its transferred state; raising
        refuses the activation."""
        return None  # by default: nothing to do

    def request_finished(self, request: Request, reason: str) -> None:
        """A request left the engine (finished, aborted) without being HELD or RESERVED."""
        return None  # by default: nothing to do

    # -- the transfers --
    @abstractmethod
    def tracks(self, request_id: str) -> bool:
        """Whether a transfer of that request is in flight (its memory is freed through poll)."""

    @abstractmethod
    def abort(self, request_id: str, reason: str) -> bool:
        """End a request's transfer; its memory comes back through poll(). False: none tracked."""

    @abstractmethod
    def poll(self) -> Sequence[TransferRecord]:
        """Drive the transfers once; what ended or changed since the last poll."""

    @abstractmethod
    def has_work(self) -> bool:
        """True while poll() has something to drive (the loop keeps polling, even when idle)."""

    def writes_awaited(self) -> int:
        """Decode side: reservations whose state is still being computed or written elsewhere (a
        prefill node works for this node now)."""
        return 0

    def current(self, request_id: str) -> TransferRecord | None:
        """The standing record of a transfer, for a waiter that comes after it was reported
        (a reservation READY or failing), else None."""
        return None

    def stats(self) -> ConnectorStats:
        return ConnectorStats()

    def close(self) -> None:
        """Close the endpoints (the engine's workers are still alive)."""
        return None  # by default: nothing to do


class LayerConnector(ABC):
    """Worker side, on every rank: what the forward calls after each decoder layer of a step whose
    `StepInput.layer_posts` names requests (the connector's `rows_scheduled` chose them: their last
    prompt chunk is in the step). Once that chunk has passed layer `layer`, the layer's state of
    those requests is final: its KV pages, its GDN conv and recurrent state. On a GPU the layer's
    kernels may still be queued: `mark` is an event recorded after them on the step's stream
    (None on the CPU), which a reader of the layer's memory waits for."""

    @abstractmethod
    def layer_done(self, request_ids: Sequence[str], layer: int, mark: DeviceMark | None) -> None:
        """Runs on the rank's step thread between two layers: must not block on the device."""
