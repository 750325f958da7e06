"""The decode node's gRPC server: `serve(addr, cfg) -> (node, port)`.

Lifecycle: load the engine (t worker processes when tensor parallel), start the engine loop
thread (serving/loop.py), bind the gRPC server (DecodeNode + health + reflection), then
register with the router and heartbeat capacity. `node.stop()` reverses it: not serving,
heartbeats stop, in-flight streams end, engine workers exit.

Requests:
- Generate without a reservation: colocated; the engine prefills the prompt itself.
- Reserve: KV pages for prompt + 1 tokens and a GDN slot set aside (EngineCore.reserve), adopted
  by the receiver endpoint of every rank under a lease (transfer/rank.py); the answer is the
  TransferTarget (every rank's agent, blocks, slot, incarnation) the prefill node writes into.
- Generate(reserved=True, first_token_id): waits (bounded by the lease) until every rank saw
  every source rank's Done, hands the memory to the engine (take) and activates the request in
  the running batch, then streams like the colocated case. A failed or expired transfer frees
  the reservation (once no write can land) and ends the call ABORTED with the reason.
- Release: aborts a reservation (pages and slot back once no write can land); with
  dead_prefill_node, first drops that node's transfer agents (the router declared it dead).
- Handshake: adds the prefill node's rank blobs as peers on every rank, answers with ours.
Draining (serving/node.py, on SIGTERM): Reserve and unreserved Generate are refused with
UNAVAILABLE + `pdserve-draining`; Generate(reserved) and Release still work, so what the router
already placed here finishes; the node stops once nothing is in flight.
Client cancellation aborts the engine request, so pages and slot return to the free lists.
Receiver endpoints are polled by the engine loop thread (the node's tick) while any
reservation is open; every engine and executor call stays on that thread. Handlers use only the
loop's API (serving/commands.py) and wait on events: a request's handle, a reservation's
`changed` (ready, failing, or the loop stopping).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import uuid

import grpc
from prometheus_client import Counter

from decode_node.config import DecodeNodeConfig
from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from proto import pb, rpc
from proto.convert import logprobs_pb, sampling_kwargs
from serving.commands import NoRoom, RequestHandle, Reservation, ShuttingDown
from serving.loop import EngineLoop
from serving.metrics import ServingMetrics, capacity_gauges
from serving.node import NodeServer, on_cancel, serve_node
from serving.rpc import MAX_REQUEST_ID_LEN
from transfer import rank as xr
from transfer.rank import RecvStatus

log = logging.getLogger("pdserve.decode")


def new_incarnation() -> int:
    return int.from_bytes(os.urandom(7), "little")


def _digest(ecfg) -> str:
    try:
        from transfer.schema import model_digest

        return model_digest(ecfg).fingerprint()
    except Exception:  # the transfer layer is optional for a colocated node
        return ""


class _Xfer:
    """One reservation awaiting (or holding) a transferred state; touched on the loop thread only,
    except the events handlers wait on. While it waits, every rank's receiver holds the lease (the
    prefill node renews it); once the state is in (`ready`) the node gives the decode call one
    more lease to take it."""

    def __init__(self, rid: str, inc: int, lease_s: float):
        self.rid, self.inc, self.lease_s = rid, inc, lease_s
        self.deadline = float("inf")  # set when ready
        self.renewals = 0  # renewals rank 0's receiver counted so far
        self.phase = "wait"  # wait -> ready -> taken | failing -> (released)
        self.error: str | None = None
        self.changed = threading.Event()  # ready, failing or released
        self.released = threading.Event()  # memory back in the free lists


class DecodeNode(NodeServer, rpc.DecodeNodeServicer):
    KIND = "decode"
    SERVICE = "DecodeNode"
    NODE_KIND = pb.NODE_KIND_DECODE

    def __init__(self, cfg: DecodeNodeConfig):
        self._init_lifecycle()
        self.cfg = cfg
        self.incarnation = new_incarnation()
        self.ecfg = cfg.engine_config()
        self.engine = EngineCore(self.ecfg)
        self.digest = _digest(self.ecfg)
        self.backend = cfg.transfer_backend
        self.blobs: list[bytes] | None = None  # every rank's receiver metadata (None: colocated only)
        self.xfers: dict[str, _Xfer] = {}  # loop thread only
        try:
            from transfer import TransferConfig

            tcfg = TransferConfig(backend=self.backend, lease_s=cfg.reservation_lease_s)
            self.blobs = self.engine.executor.call_all(xr.open_endpoint, "receiver", cfg.node_id, tcfg)
            self.digest = self.engine.executor.call_all(xr.digest, self.backend)[0]
        except Exception as e:  # no data plane here: the node still serves colocated requests
            log.warning("decode node %s: no %s transfer endpoint (%s); prefilling locally only", cfg.node_id,
                        self.backend, e)  # fmt: skip
        self.loop = EngineLoop(
            self.engine,
            name=f"{cfg.node_id}-engine",
            tick=self._tick,
            on_stop=self._on_loop_stop,
            on_change=self.changes.changed,
        ).start()
        self.metrics = ServingMetrics("pdserve_decode", lambda: capacity_gauges(self.loop.snapshot))
        reg = self.metrics.registry
        self.lease_renewals = Counter("pdserve_decode_lease_renewals",
                                      "Reservation leases restarted by a prefill node still working on the request",
                                      registry=reg)  # fmt: skip
        self.lease_expiries = Counter(
            "pdserve_decode_lease_expiries",
            "Reservations failed because their lease ran out (no renewal)",
            registry=reg,
        )

    # ---- info ---------------------------------------------------------------------------
    def _describe(self, info: pb.NodeInfo) -> None:
        info.local_prefill_threshold = self.cfg.local_prefill_threshold

    def in_flight(self) -> int:
        s = self.loop.snapshot
        return max(self.loop.num_streaming + len(self.xfers), s.running + s.waiting + s.reserved)

    def _add_servicer(self, server) -> None:
        rpc.add_DecodeNodeServicer_to_server(self, server)

    # ---- RPCs ---------------------------------------------------------------------------
    def _params(self, sampling, context) -> SamplingParams:
        try:
            return SamplingParams(**sampling_kwargs(sampling))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _request_id(self, rid: str, context) -> str:
        if len(rid) > MAX_REQUEST_ID_LEN:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id longer than {MAX_REQUEST_ID_LEN} characters")
        return rid or uuid.uuid4().hex

    def Generate(self, request, context):
        if request.reserved:
            yield from self._generate_reserved(request, context)
            return
        self.refuse_if_draining(context)
        rid = self._request_id(request.request_id, context)
        params = self._params(request.sampling, context)
        ids = list(request.prompt_token_ids)
        handle = self.loop_api(context, lambda: self.loop.submit(rid, ids, params))
        on_cancel(context, handle.abort)  # prompt, even while _relay waits
        try:
            yield from self._relay(handle, context)
        finally:  # however the call ends; a no-op for a finished request
            handle.abort()

    def _generate_reserved(self, request, context):
        rid = request.request_id
        x = self.loop_api(context, lambda: self.loop.call(lambda e: self.xfers.get(rid))) if rid else None
        if x is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no reservation {rid!r} on {self.cfg.node_id}")
        live: dict = {"handle": None}

        def cancel():  # the caller went away: end the reservation, or the decoding request
            h = live["handle"]
            if h is not None:
                h.abort()
            self._release_soon(x, "the caller went away")

        on_cancel(context, cancel)
        try:
            x.changed.wait()  # set on ready, on failing (lease, abort, the caller gone) and at stop
            if not context.is_active():
                x.released.wait(10.0)
                return
            if x.phase == "wait":  # woken by the loop stopping
                context.abort(grpc.StatusCode.UNAVAILABLE, f"decode node {self.cfg.node_id} is shutting down")
            if x.phase != "ready":
                context.abort(
                    grpc.StatusCode.ABORTED,
                    f"state transfer for request {rid} failed: {x.error}; reservation released",
                )

            def take():
                if self.xfers.get(rid) is not x or x.phase != "ready":
                    raise RuntimeError(f"reservation {rid} ended before decode began: {x.error}")
                self.engine.executor.call_all(xr.take, self.backend, rid, x.inc)
                del self.xfers[rid]
                x.phase = "taken"

            ids = request.prompt_token_ids
            first, drafts = request.first_token_id, list(request.draft_token_ids)
            handle = self.loop_api(context, lambda: self.loop.admit(rid, len(ids), first, drafts, prepare=take))
            live["handle"] = handle
        except BaseException:
            if x.phase in ("wait", "ready"):
                try:
                    self._release(rid, "the decode call ended")
                except ShuttingDown:
                    pass
            raise
        if not context.is_active():
            handle.abort()
        try:
            yield from self._relay(handle, context, skip=1)
        finally:
            handle.abort()

    def _relay(self, h: RequestHandle, context, skip: int = 0):
        """skip: leading tokens the caller already has (the prefill node's first token). Counts the
        request in the metrics once, however it ends."""
        box = {"outcome": "cancelled", "ttft": None, "tpot": None, "n": 0}
        try:
            yield from self._relay_loop(h, context, skip, box)
        finally:
            self.metrics.request_done(box["outcome"], box["ttft"], box["tpot"], box["n"])

    def _relay_loop(self, h: RequestHandle, context, skip: int, box: dict):
        first_tok = last_tok = None
        n = 0
        first_msg = True
        while True:
            try:
                item = h.next()  # every handle ends: finished, aborted (the caller's cancel) or failed
            except Exception as e:
                if isinstance(e, ValueError):
                    code = grpc.StatusCode.INVALID_ARGUMENT
                elif isinstance(e, ShuttingDown):
                    code = grpc.StatusCode.UNAVAILABLE
                else:
                    code = grpc.StatusCode.INTERNAL
                box["outcome"] = "error"
                context.abort(code, str(e))
            now = time.monotonic()
            new, lps = item.new_token_ids, item.logprobs
            if skip:
                new, lps, skip = new[skip:], (lps or [])[skip:], max(0, skip - len(new))
            if new:
                first_tok = first_tok if first_tok is not None else now
                last_tok = now
                n += len(new)
            done = item.finished
            t = pb.Timings()
            if first_tok is not None:
                t.ttft_s = first_tok - h.received
            if h.added is not None:
                t.queue_s = h.added - h.received
            if done:
                t.e2e_s = now - h.received
                if n > 1:
                    t.tpot_s = (last_tok - first_tok) / (n - 1)
            msg = pb.GenerateResponse(
                request_id=h.request_id,
                token_ids=new,
                finish_reason=item.finish_reason or "" if done else "",
                timings=t,
            )
            if lps:
                msg.logprobs.extend(logprobs_pb(lps))
            if item.prompt_logprobs:
                msg.prompt_logprobs.extend(logprobs_pb(item.prompt_logprobs))
            if first_msg:
                msg.prompt_tokens = h.num_prompt_tokens
                msg.cached_tokens = box["cached"] = item.num_cached_tokens
                msg.decode_node = self.cfg.node_id
                first_msg = False
            box["n"] = n
            if done:
                box["outcome"] = "cancelled" if item.finish_reason == "abort" else "ok"
                box["ttft"] = t.ttft_s if first_tok is not None else None
                box["tpot"] = t.tpot_s if n > 1 else None
            if new or done:
                yield msg
            if done:
                log.info(
                    "request %s: prompt %d (cached %d), output %d, %s; queue %.1f ms, ttft %.1f ms, tpot %.1f ms, "
                    "e2e %.1f ms",
                    h.request_id, h.num_prompt_tokens, box.get("cached", 0), n, item.finish_reason,
                    t.queue_s * 1e3, t.ttft_s * 1e3, t.tpot_s * 1e3, t.e2e_s * 1e3,
                )  # fmt: skip
                return

    def Reserve(self, request, context):
        if self.blobs is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"decode node {self.cfg.node_id} has no transfer endpoint")
        self.refuse_if_draining(context)
        rid = self._request_id(request.request_id, context)
        params = self._params(request.sampling, context)
        ids = list(request.prompt_token_ids)
        lease = request.lease_s or self.cfg.reservation_lease_s

        def adopt(res: Reservation):  # loop thread: every rank's receiver takes the reservation
            inc = secrets.randbits(62)
            ranks = self.engine.executor.call_all(
                xr.adopt, self.backend, rid, len(ids), list(res.block_ids), res.slot, lease, inc, res.cached_blocks
            )
            self.xfers[rid] = _Xfer(rid, inc, lease)
            return ranks

        try:
            got = self.loop_api(context, lambda: self.loop.reserve(rid, ids, params, on_reserved=adopt).result())
            ranks, cached = got.value, got.reservation.cached_blocks
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoRoom as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        return pb.ReserveResponse(
            target=pb.TransferTarget(
                request_id=rid,
                node_id=self.cfg.node_id,
                tp_size=self.cfg.tensor_parallel_size,
                schema_digest=self.digest,
                num_tokens=len(ids),
                ranks=[
                    pb.TargetRank(
                        agent=t.agent, rank=t.rank, block_ids=t.blocks, slot=t.slot, incarnation=t.incarnation
                    )
                    for t in ranks
                ],
                lease_s=lease,
                cached_blocks=cached,
            )
        )

    def _release_soon(self, x: _Xfer, reason: str) -> None:
        """Fail a reservation still open (no wait; its waiters wake on x.changed)."""

        def rel(e):
            if self.xfers.get(x.rid) is x and x.phase in ("wait", "ready"):
                self._fail(x, reason)

        try:
            self.loop.run(rel)
        except ShuttingDown:
            pass  # the loop wakes every waiter as it stops

    def _release(self, rid: str, reason: str, wait_s: float = 10.0) -> bool:
        """Abort a reservation; wait (bounded) until its memory is back. False: none under that id."""

        def rel(e):
            x = self.xfers.get(rid)
            if x is not None and x.phase in ("wait", "ready"):
                self._fail(x, reason)
            return x

        x = self.loop.call(rel)
        if x is None:
            return False
        if not x.released.wait(wait_s):
            log.warning("reservation %s: memory not back %.0f s after release (a write may be in flight)", rid, wait_s)
        return True

    def Release(self, request, context):
        if request.dead_prefill_node and self.blobs is not None:
            node = request.dead_prefill_node
            gone = self.loop_api(
                context, lambda: self.loop.call(lambda e: e.executor.call_all(xr.drop_node, self.backend, node))
            )
            if gone and gone[0]:
                log.warning("dropped the transfer agents of %s (declared dead): %s", node, ", ".join(sum(gone, [])))
        if not request.request_id:
            return pb.ReleaseResponse(released=False)
        reason = request.reason or "released by the caller"
        return pb.ReleaseResponse(released=self.loop_api(context, lambda: self._release(request.request_id, reason)))

    # ---- transfers (loop thread) ---------------------------------------------------------------
    def _fail(self, x: _Xfer, reason: str) -> None:
        log.warning("reservation %s: %s", x.rid, reason)
        self.metrics.transfer_done(0, 0.0, ok=False)
        x.phase, x.error = "failing", reason
        self.engine.executor.call_all(xr.abort_reservation, self.backend, x.rid, x.inc, reason)
        x.changed.set()

    def _tick(self) -> bool:
        if not self.xfers:
            return False
        xs = list(self.xfers.values())
        res = self.engine.executor.call_all(xr.poll_reservations, self.backend, [(x.rid, x.inc) for x in xs])
        now = time.monotonic()
        for i, x in enumerate(xs):
            per: list[RecvStatus] = [r[i] for r in res]  # this reservation on every rank
            if per[0].renewals > x.renewals:
                self.lease_renewals.inc(per[0].renewals - x.renewals)
                x.renewals = per[0].renewals
            if x.phase == "wait":
                if all(p.state == "done" for p in per):
                    x.phase = "ready"
                    x.deadline = now + x.lease_s
                    self.metrics.transfers.inc()
                    x.changed.set()
                elif any(p.state in ("failed", xr.GONE) for p in per):
                    why = next((p.error for p in per if p.error), None) or "the transfer failed"
                    if any(p.expired for p in per):
                        self.lease_expiries.inc()
                    self._fail(x, why)
                    continue
            if x.phase == "ready" and now > x.deadline:
                self.lease_expiries.inc()
                self._fail(x, "lease expired before decode began")
                continue
            if x.phase == "failing" and all(p.freed for p in per):
                self.engine.release(x.rid)
                del self.xfers[x.rid]
                x.released.set()
                x.changed.set()
        return bool(self.xfers)

    def _on_loop_stop(self) -> None:
        """Loop thread, as it exits: wake every handler waiting on a reservation."""
        for x in self.xfers.values():
            x.changed.set()
            x.released.set()


def serve(addr: str, cfg: DecodeNodeConfig) -> tuple[DecodeNode, int]:
    """Load the engine and serve on addr ("host:0" picks a port). Returns (node, port)."""
    return serve_node(DecodeNode(cfg), addr)
