"""The engine loop, shared by both node kinds: one thread owns the EngineCore; handler threads
talk to it only through the typed API below (commands in serving/commands.py).

    handler --submit / admit--> RequestHandle      --AddRequest / AdmitTransferred--> inbox
    handler --abort / reserve / release / stats / run--> Future --command--> inbox
    loop thread: commands -> EngineCore (add_request, activate, abort, reserve, release)
                 -> tick (node transfer work) -> EngineCore.step() -> RequestOutput
                 -> on_output (node hook) -> the request's RequestHandle -> handler -> client

Every request a handle streams ends with a finished output, or with an error (ValueError: the
engine refused it; ShuttingDown: the loop stopped). Aborting through a handle acts only while the
loop still streams that handle's request, so a late abort (or one for another request that reused
the id) does nothing. Once `stop()` is called every command is refused with ShuttingDown, and
whatever was queued or streaming ends with ShuttingDown: no caller waits forever.

Waits are on queues and futures: an idle loop sleeps in the inbox until a command arrives. Only
transfer progress is polled (the transports report it through polls, not events): a node's
`tick` (run on the loop thread after every command batch and step) returns True while it has
transfers in flight, and while it does an idle loop wakes every `poll_interval_s`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from serving.commands import (
    Aborted,
    AbortRequest,
    AddRequest,
    AdmitTransferred,
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
)

log = logging.getLogger("pdserve.engine")

__all__ = ["EngineLoop", "LoopError", "NoRoom", "RequestHandle", "ShuttingDown", "Snapshot", "UnknownRequest"]


class EngineLoop:
    """tick() -> bool: node work on the loop thread (transfer polling), True while transfers are
    in flight. on_output(RequestOutput): sees every output before its handle (starts pushes).
    on_stop(): run on the loop thread as it exits (nodes wake what their handlers wait on).
    on_change(): run on the loop thread each time `snapshot` is renewed (after every command and
    every pass) and as the loop exits: a node's drain re-reads what it holds then; must not block."""

    def __init__(
        self,
        engine,
        name: str = "engine",
        poll_interval_s: float = 0.001,
        tick: Callable[[], bool] | None = None,
        on_output: Callable[[Any], None] | None = None,
        on_stop: Callable[[], None] | None = None,
        on_change: Callable[[], None] | None = None,
    ):
        self.engine = engine
        self.poll_interval_s = poll_interval_s
        self._tick_fn, self._on_output, self._on_stop = tick, on_output, on_stop
        self._on_change = on_change
        self._pending = False
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}  # loop thread only
        self._lock = threading.Lock()  # orders posts against stop
        self._closed = False
        self._stop = threading.Event()
        self.iterations = 0  # loop passes (commands or steps) since start: idle means it stays put
        self.snapshot = Snapshot()
        self._snap()
        self.initial = self.snapshot  # the first snapshot (idle): what "all free" looks like
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    # ---- the API (any thread) ---------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._closed

    @property
    def num_streaming(self) -> int:
        """Requests a handle still streams (queued, computing or decoding)."""
        return len(self._handles)

    def submit(self, request_id: str, prompt_token_ids: list[int], params, prefill_only: bool = False) -> RequestHandle:
        """Queue a request for the engine; its outputs come through the handle."""
        h = RequestHandle(self._abort_handle, request_id, len(prompt_token_ids))
        self._post(AddRequest(h, list(prompt_token_ids), params, prefill_only))
        return h

    def admit(
        self,
        request_id: str,
        num_prompt_tokens: int,
        first_token: int,
        drafts=(),
        prepare: Callable[[], None] | None = None,
    ) -> RequestHandle:
        """A RESERVED request whose state has landed joins the batch with its first token
        (EngineCore.activate); `prepare` runs on the loop thread first."""
        h = RequestHandle(self._abort_handle, request_id, num_prompt_tokens)
        self._post(AdmitTransferred(h, first_token, tuple(drafts), prepare))
        return h

    def abort(self, request_id: str) -> Future[Aborted]:
        """Abort the request a handle streams under this id; UnknownRequest when there is none."""
        fut: Future = Future()
        self._post(AbortRequest(request_id, None, fut))
        return fut

    def reserve(self, request_id: str, prompt_token_ids: list[int], params, on_reserved=None) -> Future[Reserved]:
        """Set aside pages for prompt + 1 tokens and a state slot (EngineCore.reserve); NoRoom
        when there is none now, ValueError for a bad request. `on_reserved(Reservation)` runs on
        the loop thread; its result is `Reserved.value`, and if it raises the memory goes back."""
        fut: Future = Future()
        self._post(Reserve(request_id, list(prompt_token_ids), params, fut, on_reserved))
        return fut

    def release(self, request_id: str) -> Future[None]:
        """Free a HELD or RESERVED request's memory (UnknownRequest when there is no such request)."""
        fut: Future = Future()
        self._post(Release(request_id, fut))
        return fut

    def stats(self) -> Future[Snapshot]:
        """A snapshot taken on the loop thread after every command queued before this one."""
        fut: Future = Future()
        self._post(GetStats(fut))
        return fut

    def run(self, fn: Callable[[Any], Any]) -> Future:
        """fn(engine) on the loop thread (node work: executor calls, transfer state)."""
        fut: Future = Future()
        self._post(Run(fn, fut))
        return fut

    def call(self, fn: Callable[[Any], Any], timeout: float = 30.0):
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
            self._post(AbortRequest(h.request_id, h))
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
            if self._on_stop is not None:
                try:
                    self._on_stop()
                except Exception:
                    log.exception("engine loop on_stop failed")
            self._fail_all(ShuttingDown("the node is shutting down"))
            self._drain_inbox()
            if self._on_change is not None:
                self._on_change()

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            busy = eng.has_unfinished()
            try:
                if busy:
                    cmd = self._inbox.get_nowait()
                elif self._pending:  # transfers in flight: keep polling them
                    cmd = self._inbox.get(timeout=self.poll_interval_s)
                else:
                    cmd = self._inbox.get()  # idle: sleep until a command
            except queue.Empty:
                cmd = None
            self.iterations += 1
            while cmd is not None:
                self._handle(cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stop.is_set():
                break
            if self._tick_fn is not None and self._pending and eng.has_unfinished():
                self._tick()  # transfers move between steps too, not once per (long) step
            if eng.has_unfinished():
                self._step()
            if self._tick_fn is not None:
                self._tick()
            self._snap()

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # the engine is broken: fail what is in flight, keep serving
            log.exception("engine step failed")
            self._fail_all(e)
            return
        for o in outs:
            if self._on_output is not None:
                self._on_output(o)  # loop thread, before the handler sees it
            h = self._handles.get(o.request_id)
            if h is None:
                continue
            if o.finished:
                del self._handles[o.request_id]
            h._put(o)

    def _tick(self) -> None:
        try:
            self._pending = bool(self._tick_fn())
        except Exception:
            log.exception("transfer tick failed")
            self._pending = True

    def _handle(self, cmd: Command) -> None:
        match cmd:
            case AddRequest(h, ids, params, prefill_only):
                self._start(h, lambda: self._add(h.request_id, ids, params, prefill_only))
            case AdmitTransferred(h, first, drafts, prepare):
                self._start(h, lambda: self._activate(h.request_id, first, drafts, prepare))
            case AbortRequest(rid, h, fut):
                self._answer(fut, lambda: self._abort(rid, h))
            case Reserve(rid, ids, params, fut, on_reserved):
                self._answer(fut, lambda: self._reserve(rid, ids, params, on_reserved))
            case Release(rid, fut):
                self._answer(fut, lambda: self._release(rid))
            case GetStats(fut):
                self._snap()
                fut.set_result(self.snapshot)
            case Run(fn, fut):
                self._answer(fut, lambda: fn(self.engine))
            case Wake():
                pass
        self._snap()

    @staticmethod
    def _answer(fut: Future | None, fn) -> None:
        try:
            r = fn()
        except Exception as e:
            if fut is not None:
                fut.set_exception(e)
            return
        if fut is not None:
            fut.set_result(r)

    def _start(self, h: RequestHandle, add) -> None:
        """Put a request into the engine; its first output (if the start produced one) first."""
        if h.request_id in self._handles:
            h._put(Failed(ValueError(f"request id {h.request_id!r} is already in flight")))
            return
        try:
            first = add()
        except Exception as e:  # ValueError: a bad request; anything else: reported as internal
            h._put(Failed(e))
            return
        h.added = time.monotonic()
        if first is not None:
            h._put(first)
            if first.finished:
                return
        self._handles[h.request_id] = h

    def _add(self, rid: str, ids: list[int], params, prefill_only: bool) -> None:
        self.engine.add_request(ids, params, rid, prefill_only=prefill_only)  # outputs come with steps

    def _activate(self, rid: str, first: int, drafts, prepare):
        if rid not in self.engine.requests:
            raise UnknownRequest(rid, "reserved on this node")
        if prepare is not None:
            prepare()
        return self.engine.activate(rid, first, list(drafts))

    def _abort(self, rid: str, h: RequestHandle | None) -> Aborted:
        cur = self._handles.get(rid)
        if cur is None or (h is not None and cur is not h):
            if h is None:
                raise UnknownRequest(rid, "streaming on this node")
            return Aborted(rid, None)
        del self._handles[rid]
        out = self.engine.abort(rid)
        cur._put(out if out is not None else Failed(LoopError(f"request {rid} aborted")))
        return Aborted(rid, out)

    def _reserve(self, rid: str, ids: list[int], params, on_reserved) -> Reserved:
        got = self.engine.reserve(ids, params, rid)
        if got is None:
            raise NoRoom("no free KV pages or state slot for this prompt now")
        res = Reservation(rid, tuple(got[0]), got[1], got[2])
        if on_reserved is None:
            return Reserved(res)
        try:
            return Reserved(res, on_reserved(res))
        except BaseException:
            self.engine.release(rid)
            raise

    def _release(self, rid: str) -> None:
        if rid not in self.engine.requests or rid in self._handles:
            raise UnknownRequest(rid, "held or reserved on this node")
        self.engine.release(rid)

    def _fail_all(self, err: Exception) -> None:
        for rid, h in list(self._handles.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
            h._put(Failed(err))
        self._handles.clear()

    def _drain_inbox(self) -> None:
        """Answer every command still queued (the loop stopped before it ran)."""
        err = ShuttingDown("the engine loop has stopped: the node is shutting down")
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            match cmd:
                case AddRequest(h) | AdmitTransferred(h):
                    h._put(Failed(err))
                case (
                    AbortRequest(future=fut)
                    | Reserve(future=fut)
                    | Release(future=fut)
                    | GetStats(fut)
                    | Run(future=fut)
                ):
                    if fut is not None:
                        fut.set_exception(err)

    def _snap(self) -> None:
        eng = self.engine
        sched = eng.scheduler
        queued = 0
        for r in list(getattr(sched, "waiting", ())) + list(getattr(sched, "running", ())):
            queued += max(0, len(r.prompt_token_ids) - r.num_computed_tokens)
        reserved = sum(1 for r in eng.requests.values() if getattr(r.status, "value", "") == "reserved")
        self.snapshot = Snapshot(
            total_blocks=eng.capacity.num_blocks,
            free_blocks=eng.blocks.num_free,
            block_size=eng.capacity.block_size,
            total_slots=eng.capacity.num_state_slots,
            free_slots=eng.slots.num_free,
            running=len(getattr(sched, "running", ())),
            waiting=len(getattr(sched, "waiting", ())),
            queued_prefill_tokens=queued,
            reserved=reserved,
            spec_draft_tokens=sched.num_draft_tokens,
            **self._prefix_figures(),
            spec_accepted_tokens=sched.num_accepted_tokens,
            spec_drafts_per_position=tuple(sched.drafts_per_position),
            spec_accepted_per_position=tuple(sched.accepted_per_position),
        )
        if self._on_change is not None:
            self._on_change()

    def _prefix_figures(self) -> dict:
        eng = self.engine
        pc = getattr(eng, "prefix", None)
        if pc is None:
            return {}
        d = self.snapshot.prefix_digest
        if d is None or d.version != pc.version():  # rebuilt only when the cache changed
            d = pc.digest()
        return dict(
            prefix_digest=d,
            prefix_query_tokens=pc.stats.query_tokens,
            prefix_hit_tokens=pc.stats.hit_tokens,
            prefix_held_admissions=pc.stats.held,
            prefix_snapshots_used=pc.num_used,
            prefix_snapshots=pc.num_snapshots,
            prefix_snapshot_bytes=eng.capacity.snapshot_bytes,
        )
