"""The prefill side of the connector: pushes a prefill-only request's state into the decode
node's reservation named by its `PushParams`: opened when its first prompt chunk that leaves more
to compute is scheduled (streamed: each chunk's full pages go out as it finishes, and the last
chunk's layers as its forward finishes each) or else its last, the rest posted once prefilled,
its lease renewed while it is here, SendDone once every rank is quiet; phases OPENED -> POSTED,
either -> FAILING, in one enum and one table (docs/transfer.md)."""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.connector import Connector, ConnectorStats, SendDone, TransferRecord
from engine.executor import Executor
from engine.request import Request
from transfer import rank as xr
from transfer.config import TransferConfig
from transfer.connector.base import RankEndpoints, state_slot
from transfer.messages import Target

if TYPE_CHECKING:
    from engine.scheduler import SchedulerOutput

log = logging.getLogger("pdserve.transfer")


@dataclass(frozen=True)
class PushParams:
    """A prefill-only request's transfer parameters (`EngineCore.add_request(transfer=...)`)."""

    target: Target  # every destination rank's reservation
    lease_s: float = 0.0  # the reservation's lease, renewed every third of it (0: none to renew)


class PushPhase(enum.Enum):
    OPENED = "opened"  # Begin sent; the state is still computing
    POSTED = "posted"  # writes and Done posted; waiting for every rank to be done and quiet
    FAILING = "failing"  # failed or aborted; waiting for every rank to be quiet


_NEXT: dict[PushPhase, frozenset[PushPhase]] = {
    PushPhase.OPENED: frozenset({PushPhase.POSTED, PushPhase.FAILING}),
    PushPhase.POSTED: frozenset({PushPhase.FAILING}),
    PushPhase.FAILING: frozenset(),
}


@dataclass
class _Push:
    rid: str
    target: Target
    deadline: float  # push_timeout_s after it opened, after its last streamed chunk, after its post
    phase: PushPhase
    opened: tuple[list[int], int | None] | None = None  # (blocks, slot) when opened before the state existed
    streamed: bool = False  # opened before a chunk that leaves more of the prompt to compute
    by_layer: bool = False  # its last chunk's layers were posted as the forward finished each
    chunks: int = 0  # page posts made as prompt chunks finished
    preemptions: int = 0  # the request's preemptions when its push opened
    started: float = field(default_factory=time.monotonic)  # the writes were posted
    error: str | None = None
    aborted: bool = False
    computing: bool = True  # the request is still in the engine computing its prompt

    def to(self, phase: PushPhase) -> None:
        if phase not in _NEXT[self.phase]:
            raise RuntimeError(f"push {self.rid}: {self.phase.value} -> {phase.value} is not a transition")
        self.phase = phase


@dataclass
class _Lease:
    target: Target
    lease_s: float
    due: float


class PrefillConnector(RankEndpoints, Connector):
    """push_timeout_s: a push not done and quiet by then fails; spin_s: how long one poll keeps
    polling pushes that can end now, posted or failing (grants and write completions otherwise
    wait for the next step; a push whose prompt still computes is not waited for);
    stream: a prompt of several chunks opens its push with its first chunk and writes the full
    pages each chunk completes as it finishes (False: the whole state once prefilled); by_layer:
    a streamed push also writes each layer's rest (the last chunk's pages, the GDN state) as the
    last chunk's forward finishes the layer (False: all of it once the first token exists)."""

    def __init__(
        self,
        executor: Executor,
        node: str,
        config: TransferConfig,
        push_timeout_s: float = 60.0,
        spin_s: float = 0.0,
        stream: bool = True,
        by_layer: bool = True,
    ) -> None:
        super().__init__(executor, "sender", node, config)
        self.push_timeout_s, self.spin_s, self.stream = push_timeout_s, spin_s, stream
        self.by_layer = stream and by_layer
        self._pushes: dict[str, _Push] = {}
        self._leases: dict[str, _Lease] = {}
        self._unopened: dict[str, Target] = {}  # requests here whose push has not opened yet
        self._warned_late = float("-inf")  # when the last late-renewal WARNING was logged (monotonic)
        self._done = self._failed = self._bytes = 0

    # ---- the engine's calls ----------------------------------------------------------------------
    def request_added(self, request: Request) -> None:
        p = request.kv_transfer
        if isinstance(p, PushParams):
            self._unopened[request.request_id] = p.target
        if isinstance(p, PushParams) and p.lease_s > 0:
            self._leases[request.request_id] = _Lease(p.target, p.lease_s, time.monotonic() + p.lease_s / 3)

    def rows_scheduled(self, so: SchedulerOutput) -> list[str]:
        by_layer: list[str] = []  # streamed pushes whose last chunk runs now: posted layer by layer
        for row in so.rows:
            req = row.request
            p = req.kv_transfer
            if not (req.prefill_only and isinstance(p, PushParams)):
                continue
            if req.request_id in self._pushes:
                if self._layer_by_layer(self._pushes[req.request_id], req, row.samples):
                    by_layer.append(req.request_id)
                continue
            pages = self._pages(req)
            # Streamed: the chunk leaves more of the prompt to compute and the scheduler gave the
            # request every page of its prompt (the Begin names them all). A one-chunk prompt
            # keeps the single push: writing it early gains nothing.
            streamed = self.stream and not row.samples and len(req.block_ids) >= pages
            if not (row.samples or streamed):
                continue
            push = self._new(req.request_id, p.target, PushPhase.OPENED)
            push.streamed, push.preemptions = streamed, req.num_preemptions
            try:
                blocks = list(req.block_ids[:pages])  # not the MTP lookahead's
                slot = state_slot(req)
                self.call_all(
                    xr.open_send,
                    self.backend,
                    req.request_id,
                    p.target,
                    blocks,
                    slot,
                    len(req.prompt_token_ids),
                    req.rope_delta,
                )
                push.opened = (blocks, slot)
            except Exception as e:  # the request still runs; its push fails and the router retries
                self._fail(push, f"push did not open: {e}")
        return by_layer

    def _layer_by_layer(self, push: _Push, req: Request, last_chunk: bool) -> bool:
        """A streamed push whose last prompt chunk is about to run, in the memory it opened
        with: each rank writes a layer's rest (its pages of the chunk, its GDN state) as the
        forward finishes the layer, and only what is left waits for the first token."""
        if not (self.by_layer and push.streamed and last_chunk and push.phase is PushPhase.OPENED):
            return False
        if not self._same_memory(push, req):
            return False
        push.by_layer = True
        return True

    def prefill_chunk_done(self, request: Request, start: int, end: int) -> None:
        """A streamed push writes the full pages of the prompt computed so far (the last chunk's
        go with the final post, with the GDN state and the last partial page)."""
        push = self._pushes.get(request.request_id)
        if push is None or not push.streamed or push.phase is not PushPhase.OPENED:
            return
        if end >= len(request.prompt_token_ids) or end // self.block_size == start // self.block_size:
            return
        if not self._same_memory(push, request):
            return
        try:
            self.call_all(xr.post_pages, self.backend, push.rid, end // self.block_size)
            push.chunks += 1
            push.deadline = time.monotonic() + self.push_timeout_s  # a long prompt is no slow push
        except Exception as e:
            self._fail(push, f"streaming a chunk's pages failed: {e}")

    def prompt_prefilled(self, request: Request) -> None:
        rid = request.request_id
        push = self._pushes.get(rid)
        if push is not None:
            push.computing = False
            if push.phase is PushPhase.OPENED:
                self._post(push, request)
            return
        p = request.kv_transfer
        if not isinstance(p, PushParams):
            return
        push = self._new(rid, p.target, PushPhase.POSTED)
        push.computing = False
        try:
            self.call_all(
                xr.send,
                self.backend,
                rid,
                p.target,
                list(request.block_ids),
                state_slot(request),
                len(request.prompt_token_ids),
                request.rope_delta,
            )
        except Exception as e:
            self._fail(push, f"push did not start: {e}")

    def request_finished(self, request: Request, reason: str) -> None:
        rid = request.request_id
        self._leases.pop(rid, None)
        target = self._unopened.pop(rid, None)
        push = self._pushes.get(rid)
        if push is None:
            if target is not None:  # queued or computing, no push yet: the reservation goes now, not with its lease
                self._withdraw(rid, target, reason)
            return
        push.computing = False
        if push.phase is PushPhase.OPENED:
            why = (
                "the request ended before its first token"
                if reason == "abort"
                else f"the request ended before its push ({reason})"
            )
            self._fail(push, why, aborted=True, ended=True)  # not the transfer's fault: INFO on both sides

    # ---- the transfers ---------------------------------------------------------------------------
    def tracks(self, request_id: str) -> bool:
        return request_id in self._pushes

    def phase(self, request_id: str) -> PushPhase | None:
        """Where a push is (None: no push of that request in flight)."""
        push = self._pushes.get(request_id)
        return None if push is None else push.phase

    def abort(self, request_id: str, reason: str) -> bool:
        push = self._pushes.get(request_id)
        if push is None:
            return False
        if push.phase is not PushPhase.FAILING:  # asked for (a cancel): the receiver says it at INFO
            self._fail(push, reason, aborted=True, ended=True)
        return True

    def has_work(self) -> bool:
        return bool(self._pushes or self._leases)

    def poll(self) -> list[TransferRecord]:
        self._renew()
        out: list[TransferRecord] = []
        deadline = time.monotonic() + self.spin_s
        while self._pushes:
            out += self._poll_once()
            # spin for pushes that can end now (posted or failing), not for ones whose prompt is
            # still computing: those wait for steps, which the spin would only hold back
            if time.monotonic() >= deadline or all(p.phase is PushPhase.OPENED for p in self._pushes.values()):
                break
            time.sleep(0.0005)
        return out

    def stats(self) -> ConnectorStats:
        return ConnectorStats(
            in_flight=len(self._pushes), sends_done=self._done, sends_failed=self._failed, bytes_sent=self._bytes
        )

    # ---- inside --------------------------------------------------------------------------------
    def _pages(self, req: Request) -> int:
        bs = self.block_size
        return (len(req.prompt_token_ids) + bs - 1) // bs

    def _withdraw(self, rid: str, target: Target, reason: str) -> None:
        """The request ended here before its push opened (its caller cancelled it: a router gone):
        tell the destination ranks that nothing will come, so that the decode node frees its
        reservation now rather than when the lease this node no longer renews runs out."""
        why = "the request ended before its push" + (" (cancelled)" if reason == "abort" else f" ({reason})")
        try:
            self.call_all(xr.withdraw, self.backend, target, why)
        except Exception:
            log.exception("telling %s's decode node that its push will not come failed", rid)

    def _new(self, rid: str, target: Target, phase: PushPhase) -> _Push:
        self._unopened.pop(rid, None)
        push = _Push(rid, target, time.monotonic() + self.push_timeout_s, phase)
        self._pushes[rid] = push
        return push

    def _same_memory(self, push: _Push, req: Request) -> bool:
        """The request still computes into the pages and slot its push opened with and was never
        preempted since (its pages went back and may have been rewritten under a WRITE, even if
        it got the same ids again): else its push fails and the router retries. A prefill-only
        request holds its whole prompt's pages from its start, so it never needs more and is
        preempted for nobody in practice."""
        held = (list(req.block_ids[: self._pages(req)]), req.slot)
        if req.num_preemptions != push.preemptions:
            self._fail(push, f"the request was preempted after its push opened ({req.num_preemptions} times)")
            return False
        if held != push.opened:
            self._fail(push, f"the request's memory changed after its push opened ({push.opened} -> {held})")
            return False
        return True

    def _post(self, push: _Push, req: Request) -> None:
        if not self._same_memory(push, req):
            return
        try:
            self.call_all(xr.post, self.backend, push.rid)
        except Exception as e:
            self._fail(push, f"push did not start: {e}")
            return
        push.to(PushPhase.POSTED)
        push.started = time.monotonic()
        push.deadline = push.started + self.push_timeout_s

    def _fail(self, push: _Push, why: str, aborted: bool = False, ended: bool = False, asked: bool = False) -> None:
        """Some ranks may have started: abort them all; the push ends once every rank is quiet.
        ended: the request ended (length, stop, a cancel) before its push; the receiver says so
        at INFO. asked: a destination released the reservation because its caller asked (a
        cancel): said at INFO here."""
        if push.phase is PushPhase.FAILING:
            return
        (log.info if aborted or asked else log.warning)("request %s: %s", push.rid, why)
        push.to(PushPhase.FAILING)
        push.error, push.aborted = why, aborted
        self._leases.pop(push.rid, None)  # a failed push keeps no reservation alive (its node may be gone)
        try:
            self.call_all(xr.abort_send, self.backend, push.rid, why, ended)
        except Exception:
            log.exception("aborting the push of %s failed", push.rid)

    def _renew(self) -> None:
        now = time.monotonic()
        due = []
        late = 0.0  # the most time since a lease's last renewal past two thirds of it
        for lease in self._leases.values():
            if now >= lease.due:
                since = now - lease.due + lease.lease_s / 3
                if since > 2 * lease.lease_s / 3:
                    late = max(late, since / lease.lease_s)
                lease.due = now + lease.lease_s / 3
                due.append(lease.target)
        if late and now >= self._warned_late + 60:  # renewals run between steps (docs/router.md, "Leases")
            self._warned_late = now
            log.warning(
                "a reservation's lease was renewed %.0f%% of it after the last renewal: engine steps run "
                "that long, and a lease that runs out fails the request; raise the router's "
                "--reservation-lease or lower this node's --max-num-batched-tokens",
                100 * late,
            )
        if due:
            self.call_all(xr.renew, self.backend, due)

    def _poll_once(self) -> list[TransferRecord]:
        pushes = list(self._pushes.values())
        res = self.call_all(xr.poll_sends, self.backend, [p.rid for p in pushes])
        now = time.monotonic()
        out: list[TransferRecord] = []
        for i, push in enumerate(pushes):
            per = [r[i] for r in res]  # this push on every rank
            if push.phase is not PushPhase.FAILING:
                failed = [s for s in per if s.state == "failed"]
                if failed:
                    why = next((s.error for s in failed if s.error), "failed")
                    self._fail(push, why, asked=all(s.asked for s in failed))  # the other ranks too
                elif now > push.deadline:
                    self._fail(push, f"not done within {self.push_timeout_s:g} s")
            ended = all(s.state in ("done", "failed", xr.GONE) and s.quiet for s in per)
            if not ended or push.computing:  # a failed early push waits for its request to stop computing
                continue
            nbytes = sum(s.nbytes for s in per)
            self.call_all(xr.forget_send, self.backend, push.rid)
            del self._pushes[push.rid]
            self._leases.pop(push.rid, None)
            if push.error is None:
                self._done += 1
                self._bytes += nbytes
            else:
                self._failed += 1
            out.append(SendDone(push.rid, push.error, push.aborted, nbytes, now - push.started))
        return out
