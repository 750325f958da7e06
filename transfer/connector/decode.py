"""The decode side of the connector: every rank's receiver adopts the engine's reservation (pages
for prompt + 1 tokens and a GDN slot) under a lease, and the poll reports when the state is in
(RecvReady), failed (RecvFailed) or freed (RecvFreed); phases WAITING -> READY, either -> FAILING,
in one enum and one table (docs/transfer.md)."""

from __future__ import annotations

import enum
import logging
import secrets
import time
from dataclasses import dataclass

from engine.connector import Connector, ConnectorStats, RecvFailed, RecvFreed, RecvReady, TransferRecord
from engine.executor import Executor
from engine.request import Request
from transfer import rank as xr
from transfer.config import TransferConfig
from transfer.connector.base import RankEndpoints, state_slot
from transfer.messages import TargetRank

log = logging.getLogger("pdserve.transfer")

# After a reservation ends a receiver keeps reading its endpoints, at this cadence, for a grant
# timeout (TransferConfig.grant_timeout_s): a source may open a push into a reservation released a
# moment before (the client went away while the prompt computed), and it holds its pages and slot
# until this side answers its Begin (Refuse) or that timeout runs out. An idle loop reads nothing.
LINGER_POLL_S = 0.02


class ReservationPhase(enum.Enum):
    WAITING = "waiting"  # writes may land; the prefill node renews the lease
    READY = "ready"  # the whole state is in; waiting for the decode call to take it
    FAILING = "failing"  # failed, expired or released; waiting until no write can land


_NEXT: dict[ReservationPhase, frozenset[ReservationPhase]] = {
    ReservationPhase.WAITING: frozenset({ReservationPhase.READY, ReservationPhase.FAILING}),
    ReservationPhase.READY: frozenset({ReservationPhase.FAILING}),
    ReservationPhase.FAILING: frozenset(),
}


@dataclass
class _Reservation:
    rid: str
    inc: int  # the incarnation every rank adopted it under
    lease_s: float
    phase: ReservationPhase = ReservationPhase.WAITING
    deadline: float = float("inf")  # READY: take it by then
    renewals: int = 0  # renewals rank 0's receiver counted so far
    error: str | None = None
    expired: bool = False

    def to(self, phase: ReservationPhase) -> None:
        if phase not in _NEXT[self.phase]:
            raise RuntimeError(f"reservation {self.rid}: {self.phase.value} -> {phase.value} is not a transition")
        self.phase = phase

    def record(self) -> TransferRecord | None:
        if self.phase is ReservationPhase.READY:
            return RecvReady(self.rid)
        if self.phase is ReservationPhase.FAILING:
            return RecvFailed(self.rid, self.error or "failed", self.expired)
        return None


class DecodeConnector(RankEndpoints, Connector):
    """A reserved request's `kv_transfer` is its lease in seconds (None: config.lease_s)."""

    def __init__(self, executor: Executor, node: str, config: TransferConfig) -> None:
        super().__init__(executor, "receiver", node, config)
        self._res: dict[str, _Reservation] = {}
        self._out: list[TransferRecord] = []  # reported by the next poll
        self._ready = self._failed = self._renewals = self._expiries = 0
        self._linger_until = 0.0  # keep reading the endpoints until then (LINGER_POLL_S)
        self._last_poll = 0.0

    # ---- the engine's calls ----------------------------------------------------------------------
    def request_reserved(self, request: Request) -> list[TargetRank]:
        """Every rank's receiver takes the reservation; returns every rank's target, by rank."""
        rid = request.request_id
        lease = request.kv_transfer if isinstance(request.kv_transfer, (int, float)) else self.config.lease_s
        inc = secrets.randbits(62)
        ranks = self.call_all(
            xr.adopt,
            self.backend,
            rid,
            len(request.prompt_token_ids),
            list(request.block_ids),
            state_slot(request),
            float(lease),
            inc,
            request.num_cached_blocks,
        )
        self._res[rid] = _Reservation(rid, inc, float(lease))
        return sorted(ranks, key=lambda t: t.rank)

    def request_activating(self, request: Request) -> None:
        rid = request.request_id
        r = self._res.get(rid)
        if r is None or r.phase is not ReservationPhase.READY:
            why = "no transfer" if r is None else (r.error or r.phase.value)
            raise RuntimeError(f"reservation {rid} ended before decode began: {why}")
        deltas = [d for d in self.call_all(xr.take, self.backend, rid, r.inc) if d is not None]
        request.rope_delta = deltas[0] if deltas else 0  # a prompt with images: positions continue from it
        del self._res[rid]

    # ---- the transfers ---------------------------------------------------------------------------
    def tracks(self, request_id: str) -> bool:
        return request_id in self._res

    def phase(self, request_id: str) -> ReservationPhase | None:
        """Where a reservation is (None: none of that request in flight: taken, freed, never)."""
        r = self._res.get(request_id)
        return None if r is None else r.phase

    def abort(self, request_id: str, reason: str) -> bool:
        r = self._res.get(request_id)
        if r is None:
            return False
        if r.phase is not ReservationPhase.FAILING:
            self._fail(r, reason, asked=True)
        return True

    def current(self, request_id: str) -> TransferRecord | None:
        r = self._res.get(request_id)
        return None if r is None else r.record()

    def has_work(self) -> bool:
        return bool(self._res) or time.monotonic() < self._linger_until

    def writes_awaited(self) -> int:
        return sum(1 for r in self._res.values() if r.phase is ReservationPhase.WAITING)

    def stats(self) -> ConnectorStats:
        return ConnectorStats(
            in_flight=len(self._res),
            receives_ready=self._ready,
            receives_failed=self._failed,
            lease_renewals=self._renewals,
            lease_expiries=self._expiries,
        )

    def poll(self) -> list[TransferRecord]:
        now = time.monotonic()
        if self._res or (now < self._linger_until and now - self._last_poll >= LINGER_POLL_S):
            self._last_poll = now
            self._poll_once()  # with no reservation: reads the endpoints (a late Begin is refused)
        out, self._out = self._out, []
        return out

    # ---- inside --------------------------------------------------------------------------------
    def _fail(self, r: _Reservation, why: str, expired: bool = False, ended: bool = False, asked: bool = False) -> None:
        """ended: its source's request ended on its own first; asked: the router asked (a cancel,
        an end it saw first), which the sources are told. Either is no fault: INFO."""
        (log.info if ended or asked else log.warning)("reservation %s: %s", r.rid, why)
        r.to(ReservationPhase.FAILING)
        r.error, r.expired = why, expired
        self._failed += 1
        self._expiries += expired
        self._out.append(RecvFailed(r.rid, why, expired))
        self.call_all(xr.abort_reservation, self.backend, r.rid, r.inc, why, asked)

    def _poll_once(self) -> None:
        rs = list(self._res.values())
        res = self.call_all(xr.poll_reservations, self.backend, [(r.rid, r.inc) for r in rs])
        now = time.monotonic()
        for i, r in enumerate(rs):
            per = [x[i] for x in res]  # this reservation on every rank
            if per[0].renewals > r.renewals:
                self._renewals += per[0].renewals - r.renewals
                r.renewals = per[0].renewals
            if r.phase is ReservationPhase.WAITING:
                if all(p.state == "done" for p in per):
                    r.to(ReservationPhase.READY)
                    r.deadline = now + r.lease_s
                    self._ready += 1
                    self._out.append(RecvReady(r.rid))
                elif any(p.state in ("failed", xr.GONE) for p in per):
                    why = next((p.error for p in per if p.error), None) or "the transfer failed"
                    self._fail(r, why, expired=any(p.expired for p in per), ended=any(p.ended for p in per))
                    continue
            if r.phase is ReservationPhase.READY and now > r.deadline:
                self._fail(r, "lease expired before decode began", expired=True)
                continue
            if r.phase is ReservationPhase.FAILING and all(p.freed for p in per):
                del self._res[r.rid]
                self._linger_until = now + self.config.grant_timeout_s
                self._out.append(RecvFreed(r.rid))
