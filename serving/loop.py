"""The engine loop both node kinds serve from: one thread owns the EngineCore, steps it, polls its
transfers and answers handler threads through the typed API of serving/commands.py (request
handles and futures). Every wait ends: a stop ends what is queued or streaming with ShuttingDown.
Diagram and rules: docs/serving.md, "Module notes"."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from engine.connector import TransferRecord
from engine.core import EngineCore
from engine.outputs import RequestOutput
from engine.request import RequestIdInUse
from engine.sampling_params import SamplingParams
from engine.vision.inputs import ImageInput
from serving.commands import (
    Aborted,
    AbortRequest,
    AddRequest,
    AdmitTransferred,
    AwaitTransfer,
    Command,
    Failed,
    GetStats,
    LoopError,
    NoRoom,
    Release,
    RequestHandle,
    Reservation,
    Reserve,
    Reserved,
    Run,
    ShuttingDown,
    Snapshot,
    UnknownRequest,
    Wake,
    refuse_queued,
    take_snapshot,
)
from serving.mux import TokenSink
from serving.step_rate import StepRate
from serving.transfer_waits import TransferWaits

log = logging.getLogger("pdserve.engine")

__all__ = ["EngineLoop", "LoopError", "NoRoom", "RequestHandle", "ShuttingDown", "Snapshot", "UnknownRequest"]

_T = TypeVar("_T")


class EngineLoop:
    """on_change(): run on the loop thread each time `snapshot` is renewed (after every command
    and every pass) and as the loop exits: a node's drain re-reads what it holds then; must not
    block. No other hook: the transfer is the engine's connector.

    With no step to run and transfers in flight, the loop polls them every poll_interval_s,
    doubling the wait after each poll that found nothing up to max_poll_interval_s (back to the
    first interval when one ends or a command comes): an idle decode node waiting for pushes does
    not spend a core asking its ranks (one round trip each when they are processes).

    yield_to_prefill_s > 0 (a decode node on CPUs it shares with prefill nodes): while a prompt
    reserved here is still being computed or pushed, the loop holds its next step back until
    yield_to_prefill_s after the last one, polling the transfers meanwhile, so the prompt gets the
    CPUs and the decode rows wait instead (docs/router.md, `up`, "Priority")."""

    def __init__(
        self,
        engine: EngineCore,
        name: str = "engine",
        poll_interval_s: float = 0.001,
        on_change: Callable[[], None] | None = None,
        max_poll_interval_s: float = 0.004,
        yield_to_prefill_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self.yield_to_prefill_s = yield_to_prefill_s
        self._last_step = 0.0  # when the last step began (monotonic)
        self.yielded_s = 0.0  # time steps were held back for prompts computed elsewhere (yield_to_prefill_s)
        self.poll_interval_s = poll_interval_s
        self.max_poll_interval_s = max(poll_interval_s, max_poll_interval_s)
        self._wait_s = poll_interval_s  # the idle wait before the next poll
        self._on_change = on_change
        self._pending = False  # the engine has transfers in flight: keep polling
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        # loop thread only:
        self._handles: dict[str, RequestHandle] = {}  # requests streaming
        self._waits = TransferWaits()  # who waits on which transfer
        self._lock = threading.Lock()  # orders posts against stop
        self._closed = False
        self._stop = threading.Event()
        self.iterations = 0  # loop passes (commands or steps) since start: idle means it stays put
        self.prefill_rate = StepRate()  # its own prompt tokens per second (the router's estimate)
        self.snapshot = Snapshot()
        self._snap()
        self.initial = self.snapshot  # the first snapshot (idle): what "all free" looks like
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    # ---- the API (any thread) ---------------------------------------------------------------
    @property
    def num_streaming(self) -> int:
        """Requests a handle still streams (queued, computing or decoding) or waits to push, as of
        the last snapshot."""
        return self.snapshot.streaming

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prefill_only: bool = False,
        transfer: object = None,
        resume: Sequence[int] = (),
        images: Sequence[ImageInput] = (),
        sink: TokenSink | None = None,
    ) -> RequestHandle:
        """Queue a request for the engine; its outputs come through the handle (and `sink`:
        RequestHandle.deliver). transfer: the connector's parameters for it (a prefill-only
        request's push). resume: output tokens it already has (EngineCore.resume_request)."""
        h = RequestHandle(self._abort_handle, request_id, len(prompt_token_ids), sink)
        self._post(AddRequest(h, list(prompt_token_ids), params, prefill_only, transfer, tuple(resume), tuple(images)))
        return h

    def admit(
        self,
        request_id: str,
        num_prompt_tokens: int,
        first_token: int,
        drafts: Sequence[int] = (),
        prepare: Callable[[], None] | None = None,
        sink: TokenSink | None = None,
    ) -> RequestHandle:
        """A RESERVED request whose state has landed joins the batch with its first token
        (EngineCore.activate: the connector takes the state; its output, then the next token, come
        through the handle before `sink` takes any); `prepare` runs on the loop thread first."""
        h = RequestHandle(self._abort_handle, request_id, num_prompt_tokens, sink, direct_tokens=2)
        self._post(AdmitTransferred(h, first_token, tuple(drafts), prepare))
        return h

    def abort(self, request_id: str, reason: str = "aborted") -> Future[Aborted]:
        """Abort the request a handle streams under this id, or the push of one prefilled, or
        any transfer of it in flight; UnknownRequest when there is none."""
        fut: Future[Aborted] = Future()
        self._post(AbortRequest(request_id, None, fut, reason))
        return fut

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        on_reserved: Callable[[Reservation], object] | None = None,
        transfer: object = None,
        images: Sequence[ImageInput] = (),
    ) -> Future[Reserved]:
        """Set aside pages for prompt + 1 tokens and a state slot (EngineCore.reserve_transfer:
        the connector adopts them, given `transfer`); NoRoom when there is none now, ValueError
        for a bad request. `on_reserved(Reservation)` runs on the loop thread; its result is
        `Reserved.value`, and if it raises the memory goes back."""
        fut: Future[Reserved] = Future()
        self._post(Reserve(request_id, list(prompt_token_ids), params, fut, on_reserved, transfer, tuple(images)))
        return fut

    def await_transfer(self, request_id: str) -> Future[TransferRecord]:
        """A reservation's transfer: RecvReady once the state is in, RecvFailed once it failed (at
        once if it already has); UnknownRequest when no transfer of that request is in flight."""
        fut: Future[TransferRecord] = Future()
        self._post(AwaitTransfer(request_id, fut))
        return fut

    def release(self, request_id: str, reason: str = "released") -> Future[None]:
        """Free a HELD or RESERVED request's memory; a transfer on it is aborted first and the
        future answers once no write can touch the memory (UnknownRequest: no such request)."""
        fut: Future[None] = Future()
        self._post(Release(request_id, fut, reason))
        return fut

    def stats(self) -> Future[Snapshot]:
        """A snapshot taken on the loop thread after every command queued before this one."""
        fut: Future[Snapshot] = Future()
        self._post(GetStats(fut))
        return fut

    def run(self, fn: Callable[[EngineCore], _T]) -> Future[_T]:
        """fn(engine) on the loop thread."""
        cmd, fut = Run.of(fn)
        self._post(cmd)
        return fut

    def call(self, fn: Callable[[EngineCore], _T], timeout: float = 30.0) -> _T:
        """run(fn) and wait for its result."""
        return self.run(fn).result(timeout=timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new commands, end what is in flight with ShuttingDown, join the thread."""
        with self._lock:
            self._closed = True
        self._stop.set()
        self._inbox.put(Wake())
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        elif self._thread.ident is None:  # never started: answer what was queued
            self._drain_inbox()

    def _post(self, cmd: Command) -> None:
        with self._lock:
            if self._closed:
                raise ShuttingDown("the engine loop has stopped: the node is shutting down")
            self._inbox.put(cmd)

    def _abort_handle(self, h: RequestHandle) -> None:
        try:
            self._post(AbortRequest(h.request_id, h, None, "cancelled by the caller"))
        except ShuttingDown:
            pass  # the loop ends every handle itself as it stops

    # ---- the loop thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            log.exception("the engine loop died")
            raise
        finally:
            with self._lock:
                self._closed = True
            err = ShuttingDown("the node is shutting down")
            self._fail_all(err)
            self._waits.fail(err)
            self._drain_inbox()
            if self._on_change is not None:
                self._on_change()

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            busy = eng.has_unfinished()
            held = busy and self._yielding()
            cmd: Command | None
            waited = time.monotonic()
            try:
                if busy and not held:
                    cmd = self._inbox.get_nowait()
                elif self._pending or held:  # transfers in flight (held: a prompt's push to come): keep polling them
                    cmd = self._inbox.get(timeout=self._wait_s)
                else:
                    cmd = self._inbox.get()  # idle: sleep until a command
            except queue.Empty:
                cmd = None
            woke = time.monotonic()
            self.iterations += 1
            if cmd is not None:  # new work may start a transfer: poll soon again
                self._wait_s = self.poll_interval_s
            while cmd is not None:
                self._handle(cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stop.is_set():
                break
            done, paired = eng.prompt_tokens_computed, eng.prompt_pairs_computed
            if held:
                self.yielded_s += woke - waited
            stepped = eng.has_unfinished() and not self._yielding()
            if stepped:
                self._step()
            # once a pass: the previous pass's poll came just before this step (only commands between),
            # and with the model in a rank process every poll is a round trip to it
            ended = self._poll()
            self.prefill_rate.passed(
                eng.prompt_tokens_computed - done, woke, busy, pairs=eng.prompt_pairs_computed - paired
            )
            if stepped or ended or not held:  # a held pass that stepped and polled nothing has nothing new
                self._snap(fresh=not eng.has_unfinished())  # the loop may sleep next: what it reports stays

    def _yielding(self) -> bool:
        """Hold the next step back (yield_to_prefill_s): a prompt reserved here is still computed or
        written elsewhere and the last step began less than yield_to_prefill_s ago."""
        if self.yield_to_prefill_s <= 0 or time.monotonic() - self._last_step >= self.yield_to_prefill_s:
            return False
        return self.engine.writes_awaited() > 0

    def _step(self) -> None:
        self._last_step = time.monotonic()
        try:
            outs = self.engine.step()
        except Exception as e:  # the engine is broken: fail what is in flight, keep serving
            log.exception("engine step failed")
            self._fail_all(e)
            return
        sinks: dict[TokenSink, None] = {}  # the token streams this step added to
        for o in outs:
            h = self._handles.get(o.request_id)
            if h is None:
                continue
            if o.finished:
                del self._handles[o.request_id]
                self._after(h, o)
            if (sink := h.deliver(o)) is not None:
                sinks[sink] = None
        for sink in sinks:
            sink.flush()  # one message per stream per step

    def _after(self, h: RequestHandle, out: RequestOutput) -> None:
        """A handle's request finished: a prefilled one waits for its push, the others wait for nothing."""
        if out.finish_reason == "prefilled" and self.engine.tracks_transfer(h.request_id):
            self._waits.pushing[h.request_id] = h
        else:
            h._transfer_ended(None)

    def _poll(self) -> int:
        """Drive the engine's transfers; hand what ended to whoever waits for it. Returns how many
        records the poll brought."""
        eng = self.engine
        if not eng.has_transfers():
            self._pending = False
            return 0
        try:
            records = eng.poll_transfers()
        except Exception:
            log.exception("polling the transfers failed")
            records = []
        self._wait_s = self.poll_interval_s if records else min(2 * self._wait_s, self.max_poll_interval_s)
        self._waits.settle(records)
        self._pending = eng.has_transfers()
        return len(records)

    def _handle(self, cmd: Command) -> None:
        match cmd:
            case AddRequest(h, ids, params, prefill_only, transfer, resume, images):
                self._start(h, lambda: self._add(h.request_id, ids, params, prefill_only, transfer, resume, images))
            case AdmitTransferred(h, first, drafts, prepare):
                self._start(h, lambda: self._activate(h.request_id, first, drafts, prepare))
            case AbortRequest(rid, by, fut, reason):
                self._answer(fut, lambda: self._abort(rid, by, reason))
            case Reserve(rid, ids, params, fut, on_reserved, transfer, images):
                self._answer(fut, lambda: self._reserve(rid, ids, params, on_reserved, transfer, images))
            case AwaitTransfer(rid, fut):
                self._await(rid, fut)
            case Release(rid, fut, reason):
                self._release(rid, fut, reason)
            case GetStats(fut):
                self._snap()
                fut.set_result(self.snapshot)
            case Run(job):
                job(self.engine)
            case Wake():
                pass
        self._pending = self.engine.has_transfers()
        self._snap(fresh=False)  # the pass that handled it ends with a snapshot of its own

    @staticmethod
    def _answer(fut: Future[_T] | None, fn: Callable[[], _T]) -> None:
        try:
            r = fn()
        except Exception as e:
            if fut is not None:
                fut.set_exception(e)
            return
        if fut is not None:
            fut.set_result(r)

    def _start(self, h: RequestHandle, add: Callable[[], RequestOutput | None]) -> None:
        """Put a request into the engine; its first output (if the start produced one) first."""
        if h.request_id in self._handles or h.request_id in self._waits.pushing:
            h._put(Failed(RequestIdInUse(f"request id {h.request_id!r} is already in flight")))
            return
        try:
            first = add()
        except Exception as e:  # ValueError: a bad request; anything else: reported as internal
            h._put(Failed(e))
            return
        h.added = time.monotonic()
        if first is not None and first.finished:
            self._after(h, first)
        else:
            self._handles[h.request_id] = h
        if first is not None:
            h.deliver(first)  # counts toward the tokens the handle gets before its sink

    def _add(
        self, rid: str, ids: list[int], params: SamplingParams, prefill_only: bool, transfer: object,
        resume: tuple[int, ...] = (), images: tuple[ImageInput, ...] = (),
    ) -> None:  # fmt: skip
        # its outputs come with steps
        if resume:
            self.engine.resume_request(ids, params, resume, rid, images=images)
        else:
            self.engine.add_request(ids, params, rid, prefill_only=prefill_only, transfer=transfer, images=images)

    def _activate(
        self, rid: str, first: int, drafts: tuple[int, ...], prepare: Callable[[], None] | None
    ) -> RequestOutput:
        if rid not in self.engine.requests:
            raise UnknownRequest(rid, "reserved on this node")
        if prepare is not None:
            prepare()
        return self.engine.activate(rid, first, list(drafts))

    def _abort(self, rid: str, h: RequestHandle | None, reason: str) -> Aborted:
        cur = self._handles.get(rid)
        if cur is not None and (h is None or cur is h):
            del self._handles[rid]
            out = self.engine.abort(rid)
            cur._transfer_ended(None)
            cur._put(out if out is not None else Failed(LoopError(f"request {rid} aborted")))
            return Aborted(rid, out)
        pushing = self._waits.pushing.get(rid)
        if pushing is not None and (h is None or pushing is h):
            self.engine.abort_transfer(rid, reason)  # the handle gets the push's end (SendDone)
            return Aborted(rid, None)
        if h is None:
            if self.engine.abort_transfer(rid, reason):  # a push nobody waits for any more
                return Aborted(rid, None)
            raise UnknownRequest(rid, "streaming on this node")
        return Aborted(rid, None)

    def _reserve(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        on_reserved: Callable[[Reservation], object] | None,
        transfer: object,
        images: tuple[ImageInput, ...] = (),
    ) -> Reserved:
        got = self.engine.reserve_transfer(ids, params, rid, transfer, images)
        if got is None:
            raise NoRoom("no free KV pages or state slot for this prompt now")
        (blocks, slot, cached), answer = got
        res = Reservation(rid, tuple(blocks), slot, cached, answer)
        if on_reserved is None:
            return Reserved(res)
        try:
            return Reserved(res, on_reserved(res))
        except BaseException:
            self.engine.release(rid, "the reservation was refused")
            raise

    def _await(self, rid: str, fut: Future[TransferRecord]) -> None:
        if not self.engine.tracks_transfer(rid):
            fut.set_exception(UnknownRequest(rid, "with a transfer in flight on this node"))
            return
        cur = self.engine.transfer_state(rid)
        if cur is not None:
            fut.set_result(cur)
        else:
            self._waits.awaiting.setdefault(rid, []).append(fut)

    def _release(self, rid: str, fut: Future[None], reason: str) -> None:
        if rid not in self.engine.requests or rid in self._handles:
            fut.set_exception(UnknownRequest(rid, "held or reserved on this node"))
            return
        try:
            freed = self.engine.release(rid, reason)
        except Exception as e:
            fut.set_exception(e)
            return
        if freed:
            fut.set_result(None)
        else:  # answered by the poll that frees it
            self._waits.releasing.setdefault(rid, []).append(fut)

    def _fail_all(self, err: Exception) -> None:
        for rid, h in list(self._handles.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
            h._transfer_ended(None, err)
            h._put(Failed(err))
        self._handles.clear()

    def _drain_inbox(self) -> None:
        """Answer every command still queued (the loop stopped before it ran)."""
        refuse_queued(self._inbox, ShuttingDown("the engine loop has stopped: the node is shutting down"))

    def _snap(self, fresh: bool = True) -> None:
        """Renew `snapshot`; fresh=False lets a busy loop keep a prefix digest up to
        DIGEST_REFRESH_S old (serving/commands.py take_snapshot)."""
        streaming = len(self._handles) + len(self._waits.pushing)
        rate = self.prefill_rate.rate() or 0.0
        cost = self.prefill_rate.cost()
        self.snapshot = take_snapshot(self.engine, self.snapshot, streaming, rate, fresh, cost)
        if self._on_change is not None:
            self._on_change()
