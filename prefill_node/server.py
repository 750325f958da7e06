"""The prefill node's gRPC server: `serve(addr, cfg) -> (node, port)`.

An EngineCore (t worker ranks) whose requests are `prefill_only`: the engine computes the
prompt, samples the first token and HOLDS the pages and GDN slot. Every rank has a transfer
Sender (transfer/rank.py); the engine loop thread (serving/loop.py EngineLoop, shared) polls
them while a push is in flight. Every engine and executor call stays on that thread; handlers
use only the loop's API (a RequestHandle per request, futures for the rest) and wait on events
(the handle, the push's `done`), which a cancel, an Abort or the loop stopping sets.

    Prefill(prompt, sampling, target) -> queue (engine waiting list) -> prefill; when the last
      prompt chunk is scheduled, every rank opens the push (Begin to its destination ranks), so
      the grants arrive while that chunk computes -> first token
      "prefilled": every rank starts WRITEing its pieces into the target reservation (re-sharded
      a -> b) and the first message goes out at once: PrefillResponse(first token, timings:
      queue_s, prefill_s, ttft_s) -> wait (bounded) until every rank is done and quiet ->
      release the held memory -> PrefillResponse(pushed, timings: transfer_s, transfer_bytes)
      "stop" / "length" (the first token ended it): nothing to push; the one message says so
    Abort(request_id) / the caller cancelling: engine abort before the first token, else abort
      the push; the held memory is released once no write can still read it.
    While a request is here (queued, prefilling, pushing), the loop thread renews its decode
      reservation's lease every third of it (a Renew from each rank to the destination ranks it
      writes): the lease only runs out when this node stops working (docs/ARCHITECTURE.md).
    Handshake: adds the decode node's rank blobs as peers on every rank, answers with ours.

Registers with the router as prefill_ready with the prompt tokens it has queued in capacity.
Draining (serving/node.py, on SIGTERM): new Prefill calls are refused with UNAVAILABLE +
`pdserve-draining` (the router tries another prefill node, or lets the decode node prefill);
queued prompts are computed and pushed; the node stops once nothing is in flight.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import grpc

from engine.request import Status
from prefill_node.config import PrefillNodeConfig
from proto import pb, rpc
from proto.convert import sampling_kwargs
from serving.commands import LoopError, RequestHandle, ShuttingDown, UnknownRequest
from serving.loop import EngineLoop
from serving.metrics import ServingMetrics, capacity_gauges
from serving.node import NodeServer, on_cancel, serve_node
from serving.rpc import MAX_REQUEST_ID_LEN
from transfer import rank as xr
from transfer.rank import SendStatus

log = logging.getLogger("pdserve.prefill")


class _Push:
    """One request's push from the held state into its target; loop thread only (but `done`)."""

    def __init__(self, rid: str, target, deadline: float):
        self.rid, self.target, self.deadline = rid, target, deadline
        self.started = time.monotonic()  # the writes were posted (reset by post)
        self.opened: tuple[list[int], int] | None = None  # (blocks, slot) when opened before the first token
        self.posted = False
        self.finished: float | None = None
        self.error: str | None = None
        self.aborted = False
        self.nbytes = 0
        self.done = threading.Event()  # every rank terminal and quiet; held memory released


def _target(t: pb.TransferTarget):
    from transfer.messages import Target, TargetRank

    ranks = [TargetRank(r.agent, r.rank, list(r.block_ids), r.slot, r.incarnation) for r in t.ranks]
    ranks.sort(key=lambda r: r.rank)
    return Target(t.request_id, t.node_id, t.tp_size, t.schema_digest, t.num_tokens, ranks, t.cached_blocks)


class PrefillNode(NodeServer, rpc.PrefillNodeServicer):
    KIND = "prefill"
    SERVICE = "PrefillNode"
    NODE_KIND = pb.NODE_KIND_PREFILL

    def __init__(self, cfg: PrefillNodeConfig):
        from engine.core import EngineCore
        from transfer import TransferConfig

        self._init_lifecycle()
        self.cfg = cfg
        self.ecfg = cfg.engine_config()
        self.incarnation = int.from_bytes(os.urandom(7), "little")
        self.backend = cfg.transfer_backend
        self.engine = EngineCore(self.ecfg)
        try:
            tcfg = TransferConfig(backend=self.backend)
            self.blobs: list[bytes] = self.engine.executor.call_all(xr.open_endpoint, "sender", cfg.node_id, tcfg)
            self.digest = self.engine.executor.call_all(xr.digest, self.backend)[0]
        except Exception:
            self.engine.close()
            raise
        self.pushes: dict[str, _Push] = {}  # loop thread only
        self._targets: dict = {}  # request id -> Target, set by the handler before it queues the request
        # request id -> [lease_s, next renewal] of its reservation; set and removed by the handler
        # with _targets, the renewal time moved on by the loop thread
        self._leases: dict[str, list[float]] = {}
        self._started: dict[str, _Push] = {}  # request id -> its push, set by the loop thread for the handler
        self.engine.on_schedule = self._on_schedule
        self.loop = EngineLoop(
            self.engine,
            name=f"{cfg.node_id}-engine",
            tick=self._tick,
            on_output=self._on_output,
            on_stop=self._on_loop_stop,
            on_change=self.changes.changed,
        ).start()
        self.metrics = ServingMetrics("pdserve_prefill", lambda: capacity_gauges(self.loop.snapshot))

    # ---- info ---------------------------------------------------------------------------------
    def _describe(self, info: pb.NodeInfo) -> None:
        info.prefill_ready = True

    def in_flight(self) -> int:
        s = self.loop.snapshot
        return max(len(self._targets) + len(self.pushes), s.running + s.waiting)

    def _add_servicer(self, server) -> None:
        rpc.add_PrefillNodeServicer_to_server(self, server)

    # ---- Prefill ------------------------------------------------------------------------------
    def Prefill(self, request, context):
        from engine.sampling_params import SamplingParams

        self.refuse_if_draining(context)
        rid = request.request_id
        if not rid or len(rid) > MAX_REQUEST_ID_LEN:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id must have 1..{MAX_REQUEST_ID_LEN} characters")
        if not request.HasField("target") or not request.target.ranks:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a TransferTarget with every destination rank is required")
        if request.target.num_tokens != len(request.prompt_token_ids):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"target reserved for {request.target.num_tokens} tokens, the prompt has "
                f"{len(request.prompt_token_ids)}",
            )
        if request.target.schema_digest != self.digest:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"target model digest {request.target.schema_digest} differs from this node's {self.digest}",
            )
        try:
            params = SamplingParams(**sampling_kwargs(request.sampling))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        target = _target(request.target)
        ids = list(request.prompt_token_ids)
        t0 = time.monotonic()
        if rid in self._targets:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is already in flight here")
        self._targets[rid] = target
        if request.target.lease_s > 0:
            self._leases[rid] = [request.target.lease_s, t0 + request.target.lease_s / 3]
        outcome = "error"
        try:
            for resp in self._prefill(rid, ids, params, target, t0, context):
                if not resp.pushed:
                    self.metrics.ttft.observe(resp.timings.ttft_s)
                    self.metrics.tokens.inc(1)
                yield resp
            outcome = "ok"
        except BaseException:
            if not context.is_active():
                outcome = "cancelled"
            raise
        finally:
            self.metrics.requests.labels(outcome=outcome).inc()
            self._leases.pop(rid, None)
            self._targets.pop(rid, None)
            self._started.pop(rid, None)
            self.changes.changed()  # in_flight() counts _targets: wake a drain

    def _prefill(self, rid, ids, params, target, t0, context):
        """Yields the first-token message at once, then (state pushed) the `pushed` message."""
        handle = self.loop_api(context, lambda: self.loop.submit(rid, ids, params, prefill_only=True))
        state = {"push": None, "cancelled": False}

        def cancel():  # the call ended (the caller cancelled, or it is over): no-ops once finished
            state["cancelled"] = True
            handle.abort()  # before the first token
            p = state["push"]
            if p is not None:
                self._abort_push_soon(p, "cancelled by the caller")

        on_cancel(context, cancel)
        out = self._first(handle, context)
        if out is None:
            context.abort(grpc.StatusCode.CANCELLED, f"request {rid} cancelled before its first token")
        t_first = time.monotonic()
        first = out.output_token_ids[0] if out.output_token_ids else -1
        t = pb.Timings(
            queue_s=(handle.added or t0) - t0,
            prefill_s=t_first - (handle.added or t0),
            ttft_s=t_first - t0,
        )
        if out.finish_reason != "prefilled":
            if out.finish_reason not in ("stop", "length"):
                context.abort(
                    grpc.StatusCode.ABORTED, f"request {rid} ended before its first token ({out.finish_reason})"
                )
            self._log(rid, len(ids), first, t, out.finish_reason, target, out.num_cached_tokens)
            yield pb.PrefillResponse(
                first_token_id=first, timings=t, finish_reason=out.finish_reason, cached_tokens=out.num_cached_tokens
            )
            return
        push = self._started.get(rid)  # the loop thread started it when the first token came out
        if push is None:
            context.abort(grpc.StatusCode.INTERNAL, f"request {rid}: its push did not start")
        state["push"] = push
        # the first token (and MTP drafts), while the push runs
        yield pb.PrefillResponse(
            first_token_id=first, timings=t, draft_token_ids=out.draft_token_ids, cached_tokens=out.num_cached_tokens
        )
        if state["cancelled"]:
            self._abort_push_soon(push, "cancelled by the caller")
        # set by the tick once every rank is terminal and quiet (the push is bounded by its
        # deadline), or as the loop stops; the timeout is a backstop
        if not push.done.wait(max(0.0, push.deadline + 30 - time.monotonic())):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid}: the push never settled")
        t.transfer_s = (push.finished or time.monotonic()) - push.started
        t.transfer_bytes = push.nbytes
        self.metrics.transfer_done(push.nbytes, t.transfer_s, ok=push.error is None)
        if push.error is not None:
            code = grpc.StatusCode.CANCELLED if push.aborted else grpc.StatusCode.ABORTED
            self._log(rid, len(ids), first, t, f"push failed: {push.error}", target, out.num_cached_tokens)
            context.abort(code, f"request {rid}: pushing the state to {target.node} failed: {push.error}")
        self._log(rid, len(ids), first, t, "pushed", target, out.num_cached_tokens)
        yield pb.PrefillResponse(first_token_id=first, timings=t, pushed=True)

    def _first(self, handle: RequestHandle, context):
        """The request's finished output (prefilled or ended), or None when aborted / cancelled."""
        try:
            for out in handle:  # blocks on the handle; a cancel aborts it, a stop fails it
                if out.finished:
                    return None if out.finish_reason == "abort" else out
        except ShuttingDown as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except LoopError:  # aborted by id with nothing left in the engine
            return None
        except Exception as e:
            context.abort(grpc.StatusCode.INTERNAL, str(e))

    def _log(self, rid, n, first, t, what, target, cached=0) -> None:
        log.info(
            "request %s: prompt %d (cached %d) -> %s, first token %d, %s; queue %.1f ms, prefill %.1f ms, "
            "transfer %d B in %.1f ms",
            rid, n, cached, target.node, first, what, t.queue_s * 1e3, t.prefill_s * 1e3, t.transfer_bytes, t.transfer_s * 1e3,
        )  # fmt: skip

    # ---- pushes (loop thread) -----------------------------------------------------------------
    def _on_schedule(self, so) -> None:
        """A request's last prompt chunk is about to run: open its push now (Begin to every
        destination rank), so the grants come back while the chunk computes and the writes go
        out the moment the first token exists."""
        e = self.engine
        for r in so.rows:
            req = r.request
            rid = req.request_id
            target = self._targets.get(rid)
            if not (req.prefill_only and r.samples) or target is None or rid in self.pushes:
                continue
            p = _Push(rid, target, time.monotonic() + self.cfg.push_timeout_s)
            self.pushes[rid] = p
            try:
                blocks = list(req.block_ids[: e.blocks.blocks_for(len(req.prompt_token_ids))])  # not MTP lookahead
                e.executor.call_all(xr.open_send, self.backend, rid, target, blocks, req.slot,
                                    len(req.prompt_token_ids))  # fmt: skip
                p.opened = (blocks, req.slot)
            except Exception as ex:  # the request still runs; its push fails and the router retries
                self._push_failed(p, f"push did not open: {ex}")

    def _on_output(self, o) -> None:
        """Post the push as soon as the first token is out (no hop through the handler)."""
        rid = o.request_id
        p = self.pushes.get(rid)
        if o.finished and o.finish_reason == "prefilled":
            target = self._targets.get(rid)
            if target is None:  # nobody waits for it any more: nothing to push
                if p is None:
                    self.engine.release(rid)
                else:  # released by the tick once quiet
                    self._abort_push(p, "the caller went away")
                return
            self._started[rid] = self._post(p) if p is not None else self._start_push(rid, target)
        elif o.finished and p is not None and not p.posted:  # ended at its first token: nothing to push
            self._abort_push(p, f"the request ended before its push ({o.finish_reason})")

    def _post(self, p: _Push) -> _Push:
        if p.error is not None:
            return p
        e = self.engine
        try:
            held = e.held(p.rid)
            if (held[0], held[1]) != p.opened:
                raise RuntimeError(f"the request's memory changed after its push opened ({p.opened} -> {held})")
            e.executor.call_all(xr.post, self.backend, p.rid)
            p.posted, p.started = True, time.monotonic()
        except Exception as ex:
            self._push_failed(p, f"push did not start: {ex}")
        return p

    def _start_push(self, rid: str, target) -> _Push:
        e = self.engine
        p = _Push(rid, target, time.monotonic() + self.cfg.push_timeout_s)
        self.pushes[rid] = p
        try:
            blocks, slot = e.held(rid)
            n = len(e.requests[rid].prompt_token_ids)
            e.executor.call_all(xr.send, self.backend, rid, target, blocks, slot, n)
            p.posted = True
        except Exception as ex:
            self._push_failed(p, f"push did not start: {ex}")
        return p

    def _push_failed(self, p: _Push, why: str) -> None:
        """Some ranks may have started: abort them; the tick releases the memory once quiet."""
        log.warning("request %s: %s", p.rid, why)
        p.error = why
        try:
            self.engine.executor.call_all(xr.abort_send, self.backend, p.rid, why)
        except Exception:
            log.exception("aborting %s failed", p.rid)

    def _abort_push(self, p: _Push, reason: str) -> None:
        if self.pushes.get(p.rid) is not p or p.done.is_set():
            return
        p.aborted = True
        p.error = p.error or reason
        self.engine.executor.call_all(xr.abort_send, self.backend, p.rid, reason)

    def _renew(self) -> None:
        """Renew the reservation lease of every request here whose renewal is due."""
        now = time.monotonic()
        due = []
        for rid, lease in list(self._leases.items()):
            target = self._targets.get(rid)
            if target is not None and now >= lease[1]:
                lease[1] = now + lease[0] / 3
                due.append(target)
        if due:
            self.engine.executor.call_all(xr.renew, self.backend, due)

    def _tick(self) -> bool:
        self._renew()
        deadline = time.monotonic() + self.cfg.push_spin_s
        while True:
            pending = self._tick_once()
            if not pending or time.monotonic() >= deadline:
                return pending or bool(self._leases)
            time.sleep(0.0005)

    def _tick_once(self) -> bool:
        if not self.pushes:
            return False
        ps = list(self.pushes.values())
        res = self.engine.executor.call_all(xr.poll_sends, self.backend, [p.rid for p in ps])
        now = time.monotonic()
        for i, p in enumerate(ps):
            per: list[SendStatus] = [r[i] for r in res]  # this push on every rank
            if not p.posted and p.error is None and p.rid not in self.engine.requests:
                self._abort_push(p, "the request ended before its first token")  # aborted or failed
            if p.error is None and any(s.state == "failed" for s in per):
                p.error = next((s.error for s in per if s.error), "failed")
                self.engine.executor.call_all(xr.abort_send, self.backend, p.rid, p.error)  # the other ranks too
            if p.error is None and now > p.deadline:
                p.error = f"not done within {self.cfg.push_timeout_s:g} s"
                self.engine.executor.call_all(xr.abort_send, self.backend, p.rid, p.error)
            req = self.engine.requests.get(p.rid)
            computing = req is not None and req.status is not Status.HELD  # a failed early push waits for it
            if all(s.state in ("done", "failed", xr.GONE) and s.quiet for s in per) and not computing:
                p.finished = now
                p.nbytes = sum(s.nbytes for s in per)
                self.engine.executor.call_all(xr.forget_send, self.backend, p.rid)
                self.engine.release(p.rid)  # no write can still read the held pages
                del self.pushes[p.rid]
                p.done.set()
        return bool(self.pushes)

    def _abort_push_soon(self, p: _Push, reason: str) -> None:
        """Abort a push from a handler thread (no wait; the handler waits on p.done)."""
        try:
            self.loop.run(lambda e: self._abort_push(p, reason)).add_done_callback(_log_failure)
        except ShuttingDown:
            pass  # the loop ends every push as it stops

    def _on_loop_stop(self) -> None:
        """Loop thread, as it exits: end every push, so no handler waits for one."""
        for p in self.pushes.values():
            p.error = p.error or "the prefill node is shutting down"
            p.done.set()

    # ---- Abort ------------------------------------------------------------------------------------
    def Abort(self, request, context):
        """Abort a push (opened or running) and the request still computing its prompt, if any."""
        rid = request.request_id
        reason = request.reason or "aborted by the router"

        def abort_push(e) -> bool:
            p = self.pushes.get(rid)
            if p is not None:
                self._abort_push(p, reason)
            return p is not None

        pushed = self.loop_api(context, lambda: self.loop.run(abort_push))
        computing = self.loop_api(context, lambda: self.loop.abort(rid))  # after the push's, in order
        found = self.loop_api(context, lambda: pushed.result(30))
        try:
            self.loop_api(context, lambda: computing.result(30))
            found = True
        except UnknownRequest:
            pass
        return pb.AbortResponse(aborted=found)


def _log_failure(fut) -> None:
    if fut.exception() is not None:
        log.warning("engine loop call failed: %s", fut.exception())


def serve(addr: str, cfg: PrefillNodeConfig) -> tuple[PrefillNode, int]:
    return serve_node(PrefillNode(cfg), addr)
