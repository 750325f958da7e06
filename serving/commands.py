"""The engine loop's typed API (serving/loop.py): the frozen commands a handler thread posts, the
records it gets back (RequestHandle, Reserved, Snapshot ...) and the errors it can meet. State the
loop thread changes is read and changed only through these commands."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import TypeVar

from engine.cache.prefix import Digest
from engine.connector import ConnectorStats, SendDone, TransferRecord
from engine.core import EngineCore
from engine.outputs import RequestOutput
from engine.request import Request, Status
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.vision.inputs import ImageInput
from serving.mux import TokenSink
from serving.step_rate import Cost

_T = TypeVar("_T")


# ---- errors ----------------------------------------------------------------------------------
class LoopError(RuntimeError):
    """Base of the errors the engine loop answers with."""


class ShuttingDown(LoopError):
    """The loop stopped (or is stopping): the command was not run, or the request it streamed
    was cut off. Nodes answer UNAVAILABLE."""


class UnknownRequest(LoopError, LookupError):
    """No request under that id in the state the command needs."""

    def __init__(self, request_id: str, what: str = "in flight") -> None:
        super().__init__(f"no request {request_id!r} {what}")
        self.request_id = request_id


class NoRoom(LoopError):
    """A reservation found no free pages or state slot now."""


# ---- results ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Aborted:
    request_id: str
    output: RequestOutput | None  # the final (finish_reason "abort") output, None when it had ended


@dataclass(frozen=True)
class Reservation:
    request_id: str
    block_ids: tuple[int, ...]
    slot: int
    cached_blocks: int = 0  # leading pages already holding the prompt's KV here: not transferred
    transfer: object = None  # the connector's answer (decode side: every rank's TargetRank)


@dataclass(frozen=True)
class Reserved:
    reservation: Reservation
    value: object = None  # what the command's on_reserved hook returned


@dataclass(frozen=True)
class Failed:
    """The last item of a handle whose request the engine refused or lost."""

    error: BaseException


class RequestHandle:
    """One request's outputs as the loop produces them: `next()` blocks (on the handle's queue,
    no polling) until the next RequestOutput, raising the error that ended the request instead;
    the last output has `finished` set. `abort()` may be called any number of times, also after
    the end or after the loop stopped; once a prefill-only request is prefilled it aborts its push.
    `wait_transfer()` then waits for the push's end. With a token sink, next() returns only the
    first outputs and the last (`deliver`)."""

    def __init__(
        self,
        abort: Callable[[RequestHandle], None],
        request_id: str,
        num_prompt_tokens: int,
        sink: TokenSink | None = None,
        direct_tokens: int = 1,
    ) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.received = time.monotonic()  # the handler posted it
        self.added: float | None = None  # the engine took it (set by the loop before the first item)
        self.sink = sink  # its token stream (serving/mux.py), or None: every output comes through next()
        self.muxed = 0  # tokens sent on the sink before the output next() returned last
        self._direct = direct_tokens  # loop thread: tokens next() still gets before the sink takes them
        self._muxed = 0  # loop thread: tokens sent on the sink so far
        self._abort = abort
        self._items: queue.SimpleQueue[tuple[RequestOutput | Failed, int]] = queue.SimpleQueue()
        self._transfer: Future[SendDone | None] = Future()

    def next(self, timeout: float | None = None) -> RequestOutput:
        try:
            item, self.muxed = self._items.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"request {self.request_id}: no output within {timeout} s") from None
        if isinstance(item, Failed):
            raise item.error
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self.next()
            yield out
            if out.finished:
                return

    def abort(self) -> None:
        self._abort(self)

    def wait_transfer(self, timeout: float | None = None) -> SendDone | None:
        """A prefill-only request, after its "prefilled" output: the end of its push (SendDone;
        the held memory is back), or None when no push runs for it. ShuttingDown when the loop
        stopped first; TimeoutError after `timeout`."""
        try:
            return self._transfer.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"request {self.request_id}: its push did not end within {timeout} s") from None

    # loop thread
    def _put(self, item: RequestOutput | Failed) -> None:
        self._items.put((item, self._muxed))

    def deliver(self, out: RequestOutput) -> TokenSink | None:
        """Hand a step's output on: with a sink, the first `direct_tokens` tokens and the last
        output through next(), the tokens between on the sink (returned: flush it after the step);
        without one, every output through next()."""
        sink = self.sink
        if sink is None or out.finished or self._direct > 0:
            self._direct -= len(out.new_token_ids)
            self._put(out)
            return None
        if not out.new_token_ids:
            return None
        sink.add(self.request_id, out.new_token_ids, out.logprobs)
        self._muxed += len(out.new_token_ids)
        return sink

    def _transfer_ended(self, done: SendDone | None, error: BaseException | None = None) -> None:
        if self._transfer.done():
            return
        if error is not None:
            self._transfer.set_exception(error)
        else:
            self._transfer.set_result(done)


# ---- commands --------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    handle: RequestHandle
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False
    transfer: object = None  # the connector's parameters for it (a prefill node's PushParams)
    resume: tuple[int, ...] = ()  # output tokens it already has (moved from a failed node)
    images: tuple[ImageInput, ...] = ()  # the prompt's images (docs/images.md)


@dataclass(frozen=True)
class AdmitTransferred:
    handle: RequestHandle
    first_token: int
    drafts: tuple[int, ...] = ()
    # node work on the loop thread before the request joins the batch (hand the transferred
    # memory to the engine); raising ends the handle with that error
    prepare: Callable[[], None] | None = None


@dataclass(frozen=True)
class AbortRequest:
    request_id: str
    handle: RequestHandle | None = None  # set: only if still that handle's request, no error
    future: Future[Aborted] | None = None
    reason: str = "aborted"  # what a transfer it ends reports


@dataclass(frozen=True)
class Reserve:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    future: Future[Reserved]
    # node work on the loop thread once the pages are set aside; raising releases them again
    on_reserved: Callable[[Reservation], object] | None = None
    transfer: object = None  # the connector's parameters for it (decode side: the lease in seconds)
    images: tuple[ImageInput, ...] = ()  # the prompt's images' hashes and places (prefix cache names)


@dataclass(frozen=True)
class AwaitTransfer:
    request_id: str
    future: Future[TransferRecord]


@dataclass(frozen=True)
class Release:
    request_id: str
    future: Future[None]
    reason: str = "released"


@dataclass(frozen=True)
class GetStats:
    future: Future[Snapshot]


@dataclass(frozen=True)
class Run:
    job: Callable[[EngineCore], None]  # job(engine): runs the caller's function, answers its future
    fail: Callable[[BaseException], None]  # answers that future with an error instead

    @staticmethod
    def of(fn: Callable[[EngineCore], _T]) -> tuple[Run, Future[_T]]:
        """The command that runs fn(engine), and the future it answers."""
        fut: Future[_T] = Future()

        def job(engine: EngineCore) -> None:
            try:
                r = fn(engine)
            except Exception as e:
                fut.set_exception(e)
                return
            fut.set_result(r)

        return Run(job, fut.set_exception), fut


@dataclass(frozen=True)
class Wake:
    """Wakes an idle loop (stop)."""


Command = AddRequest | AdmitTransferred | AbortRequest | Reserve | AwaitTransfer | Release | GetStats | Run | Wake


@dataclass(frozen=True)
class Snapshot:
    """Capacity counters, taken by the loop thread after every command batch and step, so readers
    (heartbeats, Stats, metrics) never touch engine state from another thread."""

    total_blocks: int = 0
    free_blocks: int = 0
    block_size: int = 0
    total_slots: int = 0
    free_slots: int = 0
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    reserved: int = 0
    ended: int = 0  # requests ended since start (NodeInfo.requests_ended)
    preemptions: int = 0  # requests preempted since start (pages ran out; they recompute)
    spec_draft_tokens: int = 0  # totals since start (speculative decoding)
    prefix_query_tokens: int = 0  # totals since start (prefix caching): prompt tokens looked up ...
    prefix_hit_tokens: int = 0  # ... and found in the cache
    prefix_held_admissions: int = 0  # requests whose admission waited for a running request's snapshot
    prefix_snapshots_used: int = 0  # GDN state snapshots held, of prefix_snapshots
    prefix_snapshots_evicted: int = 0  # totals since start: snapshots dropped for newer ones ...
    prefix_pages_evicted: int = 0  # ... and cached pages handed out again
    prefix_snapshots: int = 0
    prefix_snapshot_bytes: int = 0  # the snapshot pool's memory, per rank
    prefix_digest: Digest | None = None  # what the prefix cache holds (None: no cache)
    prefix_digest_at: float = 0.0  # time.monotonic() it was built at
    spec_accepted_tokens: int = 0
    spec_drafts_per_position: tuple[int, ...] = field(default=())  # drafts verified at place i + 1, and accepted
    spec_accepted_per_position: tuple[int, ...] = field(default=())
    transfer: ConnectorStats = field(default_factory=ConnectorStats)  # the connector's totals (zeros: none)
    streaming: int = 0  # requests a handle streams or whose push it waits for
    images: tuple[int, float, int] = (0, 0.0, 0)  # totals: images encoded, encoder seconds, encoder-cache hits
    prefill_tokens_per_s: float = 0.0  # its recent passes' prompt tokens per second (serving/step_rate.py)
    prefill_cost: Cost | None = None  # (s per token, s per pair, least s per token) fitted over them (StepRate.cost)


# While the loop is busy, the prefix digest is rebuilt at most this often: the cache changes with
# nearly every request (a digest names up to 1,024 pages, about 1 ms of Python), while the router
# reads it with each heartbeat (0.5 s)
DIGEST_REFRESH_S = 0.1


def _computed(sched: Scheduler, r: Request) -> int:
    """Prompt tokens of r the node need not compute: what it computed, or, before its first
    admission, the prefix-cache hit it would get now (looked up once: it changes nothing). The
    queue the router reads is then in the router's own unit, prompts less their cached prefixes."""
    if r.num_computed_tokens or sched.plan is None:
        return r.num_computed_tokens
    if r.expected_hit is None:
        hit = sched.plan.lookup(r)
        r.expected_hit = hit.num_tokens if hit is not None else 0
    return r.expected_hit


def take_snapshot(
    eng: EngineCore,
    previous: Snapshot,
    streaming: int = 0,
    prefill_rate: float = 0.0,
    fresh: bool = True,
    prefill_cost: Cost | None = None,
) -> Snapshot:
    """The engine's counters now (loop thread). The prefix digest is rebuilt when the cache changed:
    at once when `fresh` (the loop is going idle, or someone asked), else once DIGEST_REFRESH_S has
    passed since the last build."""
    sched = eng.scheduler
    queued = sum(max(0, len(r.prompt_token_ids) - _computed(sched, r)) for r in [*sched.waiting, *sched.running])
    snap = Snapshot(
        total_blocks=eng.capacity.num_blocks,
        free_blocks=eng.blocks.num_free,
        block_size=eng.capacity.block_size,
        total_slots=eng.capacity.num_state_slots,
        free_slots=eng.slots.num_free,
        running=len(sched.running),
        waiting=len(sched.waiting),
        queued_prefill_tokens=queued,
        reserved=sum(1 for r in eng.requests.values() if r.status is Status.RESERVED),
        ended=sched.ended_total,
        preemptions=sched.preemptions_total,
        spec_draft_tokens=sched.num_draft_tokens,
        spec_accepted_tokens=sched.num_accepted_tokens,
        spec_drafts_per_position=tuple(sched.drafts_per_position),
        spec_accepted_per_position=tuple(sched.accepted_per_position),
        transfer=eng.transfer_stats() or ConnectorStats(),
        streaming=streaming,
        images=eng.image_totals,
        prefill_tokens_per_s=prefill_rate,
        prefill_cost=prefill_cost,
    )
    pc = eng.prefix
    if pc is None:
        return snap
    d, at = previous.prefix_digest, previous.prefix_digest_at
    if d is None or d.version != pc.version():
        now = time.monotonic()
        if d is None or fresh or now - at >= DIGEST_REFRESH_S:
            d, at = pc.digest(), now
    return replace(
        snap,
        prefix_digest=d,
        prefix_digest_at=at,
        prefix_query_tokens=pc.stats.query_tokens,
        prefix_hit_tokens=pc.stats.hit_tokens,
        prefix_held_admissions=pc.stats.held,
        prefix_snapshots_used=pc.num_used,
        prefix_snapshots_evicted=pc.stats.evicted,
        prefix_pages_evicted=eng.blocks.num_evicted,
        prefix_snapshots=pc.num_snapshots,
        prefix_snapshot_bytes=eng.capacity.snapshot_bytes,
    )


def settle(fut: Future[_T], value: _T) -> None:
    """Answer a future nobody else may have answered yet."""
    if not fut.done():
        fut.set_result(value)


def refuse(fut: Future[_T], error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)


def refuse_queued(inbox: queue.SimpleQueue[Command], err: BaseException) -> None:
    """Answer every command still in `inbox` with `err` (the loop stopped before it ran them)."""
    while True:
        try:
            cmd = inbox.get_nowait()
        except queue.Empty:
            return
        match cmd:
            case AddRequest(h) | AdmitTransferred(h):
                h._transfer_ended(None, err)
                h._put(Failed(err))
            case AbortRequest(future=fut) | Reserve(future=fut) | AwaitTransfer(future=fut) | Release(future=fut):
                if fut is not None:
                    fut.set_exception(err)
            case GetStats(fut):
                fut.set_exception(err)
            case Run(fail=fail):
                fail(err)
