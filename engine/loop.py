"""The engine loop, shared by both node kinds: one thread owns the EngineCore; gRPC handler
threads talk to it by queues.

    handler --submit(rid, ids, params)--> inbox --(loop thread) add_request / abort / call-->
    EngineCore.step() -> RequestOutput -> the request's Stream (a queue) -> handler -> client

A handler's `Stream` yields ("out", RequestOutput) items until a finished one, or a single
("error", ValueError) when the engine refused the request. Aborting an id is keyed by its Stream,
so a late abort for a finished request (or another request that reused the id) does nothing.
Capacity counters are snapshotted by the loop thread after every command and step, so readers
(heartbeats, Stats) never touch engine state from another thread.

Transfer endpoints are polled, never threaded: a node sets `tick` (a function run on the loop
thread after every command batch and step, returning True while it has transfers in flight);
while it does, an idle loop wakes every `poll_interval_s` instead of sleeping until work.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

log = logging.getLogger("pdserve.engine")


class ShuttingDown(RuntimeError):
    """The node is stopping: requests still in flight end with UNAVAILABLE."""


@dataclass
class Stream:
    request_id: str
    num_prompt_tokens: int
    received: float = field(default_factory=time.monotonic)  # handler got it
    added: float | None = None  # the engine took it
    q: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    def get(self, timeout: float | None = None):
        return self.q.get(timeout=timeout)


@dataclass(frozen=True)
class Snapshot:
    total_blocks: int = 0
    free_blocks: int = 0
    block_size: int = 0
    total_slots: int = 0
    free_slots: int = 0
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    reserved: int = 0
    spec_draft_tokens: int = 0  # totals since start (speculative decoding)
    prefix_query_tokens: int = 0  # totals since start (prefix caching): prompt tokens looked up ...
    prefix_hit_tokens: int = 0  # ... and found in the cache
    prefix_snapshots_used: int = 0  # GDN state snapshots held, of prefix_snapshots
    prefix_snapshots: int = 0
    prefix_snapshot_bytes: int = 0  # the snapshot pool's memory, per rank
    spec_accepted_tokens: int = 0
    spec_drafts_per_position: tuple[int, ...] = ()  # drafts verified at place i + 1 of a row, and accepted
    spec_accepted_per_position: tuple[int, ...] = ()


class EngineLoop:
    def __init__(self, engine, name: str = "engine", poll_interval_s: float = 0.001):
        self.engine = engine
        self.tick = None  # () -> bool: node work on the loop thread (transfer polling)
        self.on_output = None  # (RequestOutput) -> None: sees every output first (starts pushes)
        self.poll_interval_s = poll_interval_s
        self._pending = False
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, Stream] = {}
        self.snapshot = Snapshot()
        self.initial = None  # the first snapshot (idle): what "all free" looks like
        self._stop = threading.Event()
        self._snap()
        self.initial = self.snapshot
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> EngineLoop:
        self.thread.start()
        return self

    # ---- called from handler threads ----------------------------------------------------
    def submit(
        self, request_id: str, prompt_token_ids: list[int], params, prefill_only: bool = False, start=None
    ) -> Stream:
        """Queue a request. `start(engine) -> RequestOutput` replaces add_request (a reservation
        joining the batch: EngineCore.activate); its output is the stream's first item."""
        s = Stream(request_id, len(prompt_token_ids))
        self.inbox.put(("add", s, prompt_token_ids, params, prefill_only, start))
        return s

    def abort(self, stream: Stream) -> None:
        self.inbox.put(("abort", stream))

    def call(self, fn, timeout: float = 30.0):
        """Run fn(engine) on the loop thread (reservations and other engine state)."""
        fut: Future = Future()
        self.inbox.put(("call", fn, fut))
        return fut.result(timeout=timeout)

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("wake",))
        self.thread.join(timeout=30)

    # ---- the loop thread -------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            busy = eng.has_unfinished()
            try:
                if busy:
                    cmd = self.inbox.get_nowait()
                elif self._pending:  # transfers in flight: keep polling them
                    cmd = self.inbox.get(timeout=self.poll_interval_s)
                else:
                    cmd = self.inbox.get()  # idle: sleep until work
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._handle(cmd)
                try:
                    cmd = self.inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stop.is_set():
                break
            if self.tick is not None and self._pending and eng.has_unfinished():
                self._tick()  # transfers move between steps too, not once per (long) step
            if eng.has_unfinished():
                try:
                    outs = eng.step()
                except Exception as e:  # the engine is broken: fail what is in flight, keep serving
                    log.exception("engine step failed")
                    self._fail_all(e)
                    outs = []
                for o in outs:
                    if self.on_output is not None:
                        self.on_output(o)  # loop thread, before the handler sees it
                    s = self.streams.get(o.request_id)
                    if s is None:
                        continue
                    if o.finished:
                        del self.streams[o.request_id]
                    s.q.put(("out", o))
            if self.tick is not None:
                self._tick()
            self._snap()
        self._fail_all(ShuttingDown("the node is shutting down"))

    def _tick(self) -> None:
        try:
            self._pending = bool(self.tick())
        except Exception:
            log.exception("transfer tick failed")
            self._pending = True

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, s, ids, params, prefill_only, start = cmd
            try:
                if start is not None:
                    first = start(self.engine)
                else:
                    self.engine.add_request(ids, params, s.request_id, prefill_only=prefill_only)
                    first = None
            except Exception as e:  # ValueError: a bad request; anything else: reported as internal
                s.q.put(("error", e))
                return
            s.added = time.monotonic()
            if first is not None:
                s.q.put(("out", first))
                if first.finished:
                    return
            self.streams[s.request_id] = s
        elif kind == "abort":
            s = cmd[1]
            if self.streams.get(s.request_id) is s:
                del self.streams[s.request_id]
                out = self.engine.abort(s.request_id)
                if out is not None:
                    s.q.put(("out", out))
        elif kind == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:
                fut.set_exception(e)
        self._snap()

    def _fail_all(self, err: Exception) -> None:
        for rid, s in list(self.streams.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
            s.q.put(("error", err))
        self.streams.clear()

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
            **_prefix_figures(eng),
            spec_accepted_tokens=sched.num_accepted_tokens,
            spec_drafts_per_position=tuple(sched.drafts_per_position),
            spec_accepted_per_position=tuple(sched.accepted_per_position),
        )


def _prefix_figures(eng) -> dict:
    pc = getattr(eng, "prefix", None)
    if pc is None:
        return {}
    return dict(
        prefix_query_tokens=pc.stats.query_tokens,
        prefix_hit_tokens=pc.stats.hit_tokens,
        prefix_snapshots_used=pc.num_used,
        prefix_snapshots=pc.num_snapshots,
        prefix_snapshot_bytes=eng.capacity.snapshot_bytes,
    )
