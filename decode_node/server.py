"""The decode node's gRPC server, `serve(addr, cfg) -> (node, port)`: maps Generate (colocated, or
reserved after a transfer), Reserve, Release and Handshake to the engine loop (serving/loop.py);
the engine's connector (transfer/connector/decode.py) receives the state into reservations.
Lifecycle and drain: docs/serving.md, "Module notes"."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import grpc

from decode_node.config import DecodeNodeConfig
from engine.config import EngineConfig
from engine.connector import RecvFailed
from engine.core import EngineCore
from engine.request import RequestIdInUse
from engine.sampling_params import SamplingParams
from proto import pb, rpc
from proto.convert import logprobs_pb, sampling_kwargs
from serving.commands import NoRoom, RequestHandle, ShuttingDown, UnknownRequest
from serving.loop import EngineLoop
from serving.metrics import Gauges, ServingMetrics, capacity_gauges
from serving.mux import TokenSinks
from serving.node import NodeServer, on_cancel, serve_node
from serving.rpc import MAX_REQUEST_ID_LEN, Interrupt, images_of, refuse_draining, refuse_memory
from serving.vllm_metrics import register_node as register_vllm
from transfer import TransferConfig
from transfer.connector import DecodeConnector
from transfer.messages import TargetRank
from transfer.netif import interface_of

log = logging.getLogger("pdserve.decode")


def new_incarnation() -> int:
    return int.from_bytes(os.urandom(7), "little")


def _digest(ecfg: EngineConfig) -> str:
    try:
        from transfer.schema import model_digest

        return model_digest(ecfg).fingerprint()
    except Exception:  # the transfer layer is optional for a colocated node
        return ""


@dataclass
class _Tally:
    """How one relayed request went, for the metrics and its log line (once, however it ends:
    finished, failed, or its caller gone)."""

    outcome: str = "cancelled"
    finish: str = "cancelled"  # the finish reason; "cancelled" when the call ended before it
    ttft: float | None = None
    tpot: float | None = None
    n: int = 0  # tokens this node sent (the metrics' count)
    prefilled: int = 0  # the request's tokens the prefill node sampled (its first): the log line counts them too
    cached: int = 0
    queue_s: float = 0.0
    first_s: float | None = None  # to the first token, for the log line (ttft counts finished requests only)

    def log(self, h: RequestHandle) -> None:
        def ms(s: float | None) -> str:
            return "-" if s is None else f"{s * 1e3:.1f} ms"

        # the request's output tokens, as the router's line counts them: the prefill node's first one too
        output = f"{self.n + self.prefilled}" + (f" ({self.prefilled} from the prefill node)" if self.prefilled else "")
        log.info(
            "request %s: prompt %d (cached %d), output %s, %s; queue %s, ttft %s, tpot %s, e2e %s",
            h.request_id, h.num_prompt_tokens, self.cached, output, self.finish,
            ms(self.queue_s), ms(self.first_s), ms(self.tpot), ms(time.monotonic() - h.received),
        )  # fmt: skip


class DecodeNode(NodeServer, rpc.DecodeNodeServicer):
    KIND = "decode"
    SERVICE = "DecodeNode"
    NODE_KIND = pb.NODE_KIND_DECODE
    cfg: DecodeNodeConfig
    connector: DecodeConnector | None

    def __init__(self, cfg: DecodeNodeConfig) -> None:
        self._init_lifecycle()
        self.cfg = cfg
        self.incarnation = new_incarnation()
        self.ecfg = cfg.engine_config()
        self.engine = EngineCore(self.ecfg)
        self.engine.scheduler.short_active = False  # until the router reports a prefill pool (heard)
        self.digest = _digest(self.ecfg)
        self.backend = cfg.transfer_backend
        self.connector: DecodeConnector | None = None  # None: colocated requests only
        interface_of(cfg.data_host)  # a data plane host not on this machine is an error, not a colocated node
        try:
            tcfg = TransferConfig(
                backend=self.backend,
                lease_s=cfg.reservation_lease_s,
                bind_host=cfg.data_host,
                allow_tcp_staging=cfg.allow_tcp_staging,
            )
            self.connector = DecodeConnector(self.engine.executor, cfg.node_id, tcfg)
            self.digest = self.connector.digest
            self.engine.use_connector(self.connector)
        except Exception as e:  # no data plane here: the node still serves colocated requests
            log.warning("decode node %s: no %s transfer endpoint (%s); prefilling locally only", cfg.node_id,
                        self.backend, e)  # fmt: skip
        self.loop = EngineLoop(
            self.engine,
            name=f"{cfg.node_id}-engine",
            on_change=self.changes.changed,
            yield_to_prefill_s=cfg.yield_to_prefill_ms / 1e3,
        ).start()
        self.metrics = ServingMetrics("pdserve_decode", self._gauges)
        register_vllm(self.metrics.registry, cfg.model, cfg.served_model_name, lambda: self.loop.snapshot)
        self._streams: set[str] = set()  # request ids a Generate call streams now
        self.sinks = TokenSinks()  # the callers' token streams (TokenStream, serving/mux.py)
        self.handing_off = False  # the drain hands the streams left to the router (drain_handoff_s)

    def heard(self, hb: pb.HeartbeatResponse) -> None:
        # the short-prompt cap holds while a prefill pool takes the rest (engine/scheduler/batching.py)
        self.engine.scheduler.short_active = hb.prefill_pool

    def _gauges(self) -> Gauges:
        s = self.loop.snapshot
        return {
            **capacity_gauges(s),
            "lease_renewals_total": (
                "Reservation leases restarted by a prefill node still working on the request",
                s.transfer.lease_renewals,
            ),
            "lease_expiries_total": (
                "Reservations failed because their lease ran out (no renewal)",
                s.transfer.lease_expiries,
            ),
            "prefill_yield_seconds_total": (
                "Time decode steps were held back for prompts computing for this node (--yield-to-prefill-ms)",
                round(self.loop.yielded_s, 3),
            ),
        }

    # ---- info ---------------------------------------------------------------------------
    def _describe(self, info: pb.NodeInfo) -> None:
        info.local_prefill_threshold = self.cfg.local_prefill_threshold
        info.local_resume_threshold = self.cfg.local_resume_threshold

    def in_flight(self) -> int:
        s = self.loop.snapshot
        return max(s.streaming + s.transfer.in_flight, s.running + s.waiting + s.reserved)

    def drain(self, timeout_s: float, interrupt: Interrupt | None = None) -> bool:
        """The plain drain; with drain_handoff_s, the streams still running after that long end
        UNAVAILABLE (draining) and the router moves them with the tokens they sent."""
        wait = self.cfg.drain_handoff_s
        if wait <= 0 or wait >= timeout_s:
            return super().drain(timeout_s, interrupt)
        if super().drain(wait, interrupt):
            return True
        if not self._someone_to_take_over():  # the router could only fail them once its admission wait ran out
            why = f"no other decode node is up to take its {len(self._streams)} stream(s)"
            log.warning("decode node %s: --drain-handoff: %s; finishing them here", self.cfg.node_id, why)
            return super().drain(timeout_s - wait, interrupt)
        self.handing_off = True
        rids = list(self._streams)
        log.info("decode node %s: handing %d stream(s) off to the router", self.cfg.node_id, len(rids))
        for rid in rids:
            self.loop.abort(rid, "handed off (drain)")
        return super().drain(timeout_s - wait, interrupt)

    def _someone_to_take_over(self) -> bool:
        """A router of this node knows another decode node that is up and not draining."""
        for hb in self._hbs:
            for n in hb.nodes() or ():
                if n.alive and n.node.kind == pb.NODE_KIND_DECODE and n.node.node_id != self.cfg.node_id:
                    if not n.node.draining:
                        return True
        return False

    def _add_servicer(self, server: grpc.Server) -> None:
        rpc.add_DecodeNodeServicer_to_server(self, server)

    def stop(self, grace: float | None = 2.0) -> None:
        self.sinks.close_all()  # the token streams end with the node, not after the server's grace
        super().stop(grace)

    # ---- RPCs ---------------------------------------------------------------------------
    def _params(self, sampling: pb.SamplingParams, context: grpc.ServicerContext) -> SamplingParams:
        try:
            return SamplingParams(**sampling_kwargs(sampling))  # type: ignore[no-untyped-call]  # its **kwargs init
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise

    def _request_id(self, rid: str, context: grpc.ServicerContext) -> str:
        if len(rid) > MAX_REQUEST_ID_LEN:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id longer than {MAX_REQUEST_ID_LEN} characters")
        return rid or uuid.uuid4().hex

    def Generate(self, request: pb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        if request.reserved:
            yield from self._generate_reserved(request, context)
            return
        self.refuse_if_draining(context)
        rid = self._request_id(request.request_id, context)
        params = self._params(request.sampling, context)
        ids, resume = list(request.prompt_token_ids), list(request.resume_token_ids)
        images = images_of(
            request.images, context, model=self.ecfg.model.path if request.images and self.ecfg.model.vision else None
        )
        sink = self.sinks.get(request.token_stream)
        handle = self.loop_api(
            context, lambda: self.loop.submit(rid, ids, params, resume=resume, images=images, sink=sink)
        )
        on_cancel(context, handle.abort)  # prompt, even while _relay waits
        try:
            yield from self._relay(handle, context)
        finally:  # however the call ends; a no-op for a finished request
            handle.abort()

    def _generate_reserved(
        self, request: pb.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        rid = request.request_id
        try:
            ready = self.loop_api(context, lambda: self.loop.await_transfer(rid)) if rid else None
        except UnknownRequest:
            ready = None
        if ready is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no reservation {rid!r} on {self.cfg.node_id}")
            return
        live: list[RequestHandle] = []

        def cancel() -> None:  # the caller went away: end the decoding request, or the reservation
            for h in live:
                h.abort()
            self._release(rid, "the caller went away", wait_s=0)  # a no-op once it decodes

        on_cancel(context, cancel)
        failed = False
        try:
            try:
                rec = ready.result()  # ready, or failed (lease, abort, the caller gone)
            except UnknownRequest:
                rec = RecvFailed(rid, "the reservation ended")
            except ShuttingDown:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"decode node {self.cfg.node_id} is shutting down")
                return
            if isinstance(rec, RecvFailed):
                failed = True  # its memory comes back on its own once no write can land
                self.metrics.transfer_done(0, 0.0, ok=False)
                if not context.is_active():
                    self._release(rid, "the caller went away")
                    return
                context.abort(
                    grpc.StatusCode.ABORTED,
                    f"state transfer for request {rid} failed: {rec.error}; reservation released",
                )
                return
            self.metrics.transfers.inc()
            if not context.is_active():
                self._release(rid, "the caller went away")
                return
            ids = request.prompt_token_ids
            first, drafts = request.first_token_id, list(request.draft_token_ids)
            sink = self.sinks.get(request.token_stream)
            handle = self.loop_api(context, lambda: self.loop.admit(rid, len(ids), first, drafts, sink=sink))
            live.append(handle)
        except BaseException:
            if not failed:
                self._release(rid, "the decode call ended")
            raise
        if not context.is_active():
            handle.abort()
        try:
            yield from self._relay(handle, context, skip=1)
        finally:
            handle.abort()

    def _relay(self, h: RequestHandle, context: grpc.ServicerContext, skip: int = 0) -> Iterator[pb.GenerateResponse]:
        """skip: leading tokens the caller already has (the prefill node's first token). Counts the
        request in the metrics once, however it ends."""
        box = _Tally(prefilled=skip)
        self._streams.add(h.request_id)
        if self.handing_off:  # it began decoding after the drain handed the streams off (its push was
            self.loop.abort(h.request_id, "handed off (drain)")  # under way then): it goes too
        try:
            yield from self._relay_loop(h, context, skip, box)
        finally:
            self._streams.discard(h.request_id)
            self.metrics.request_done(box.outcome, box.ttft, box.tpot, box.n)
            box.log(h)

    def _relay_loop(
        self, h: RequestHandle, context: grpc.ServicerContext, skip: int, box: _Tally
    ) -> Iterator[pb.GenerateResponse]:
        first_tok: float | None = None
        last_tok: float | None = None
        n = 0
        first_msg = True
        while True:
            try:
                item = h.next()  # every handle ends: finished, aborted (the caller's cancel) or failed
            except Exception as e:
                if isinstance(e, RequestIdInUse):  # held here still (a reservation not quiet yet)
                    code = grpc.StatusCode.ALREADY_EXISTS
                elif isinstance(e, ValueError):
                    code = grpc.StatusCode.INVALID_ARGUMENT
                elif isinstance(e, ShuttingDown):
                    code = grpc.StatusCode.UNAVAILABLE
                else:
                    code = grpc.StatusCode.INTERNAL
                box.outcome = box.finish = "error"
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
            if h.muxed:  # the tokens between came on the token stream: the last one is about now
                last_tok = now
            if done and item.finish_reason == "abort" and self.handing_off:  # the drain hands it off
                if new or h.muxed:
                    yield pb.GenerateResponse(
                        request_id=h.request_id, token_ids=new, logprobs=logprobs_pb(lps or []), muxed_tokens=h.muxed
                    )
                box.finish = "handed off"
                refuse_draining(context, f"decode node {self.cfg.node_id}")
            if done and item.finish_reason == "abort" and context.is_active():  # not the caller's cancel:
                if new or h.muxed:  # the node gave its memory up (an image request without pixels here)
                    yield pb.GenerateResponse(
                        request_id=h.request_id, token_ids=new, logprobs=logprobs_pb(lps or []), muxed_tokens=h.muxed
                    )
                box.finish = "memory given up"
                refuse_memory(
                    context, f"decode node {self.cfg.node_id} gave the request's memory up: its images are not there"
                )
            t = pb.Timings()
            if first_tok is not None:
                t.ttft_s = box.first_s = first_tok - h.received
            if h.added is not None:
                t.queue_s = box.queue_s = h.added - h.received
            total = n + h.muxed  # the tokens sent on the token stream too
            if done:
                t.e2e_s = now - h.received
                if total > 1 and first_tok is not None and last_tok is not None:
                    t.tpot_s = (last_tok - first_tok) / (total - 1)
            msg = pb.GenerateResponse(
                request_id=h.request_id,
                token_ids=new,
                finish_reason=item.finish_reason or "" if done else "",
                timings=t,
                muxed_tokens=h.muxed,
            )
            if lps:
                msg.logprobs.extend(logprobs_pb(lps))
            if item.prompt_logprobs:
                msg.prompt_logprobs.extend(logprobs_pb(item.prompt_logprobs))
            if first_msg:
                msg.prompt_tokens = h.num_prompt_tokens
                msg.cached_tokens = box.cached = item.num_cached_tokens
                msg.decode_node = self.cfg.node_id
                first_msg = False
            box.n = total
            if done:
                msg.node_ended = int(item.metrics.get("ended", 0))
                box.outcome = "cancelled" if item.finish_reason == "abort" else "ok"
                box.finish = box.outcome if item.finish_reason == "abort" else item.finish_reason or "stop"
                box.ttft = t.ttft_s if first_tok is not None else None
                box.tpot = t.tpot_s if total > 1 else None
            if new or done:
                yield msg
            if done:
                return

    def TokenStream(self, request: pb.TokenStreamRequest, context: grpc.ServicerContext) -> Iterator[pb.TokenBatch]:
        """A caller's token stream (serving/mux.py): one message per engine step with the tokens of
        every request whose Generate named it; open until the caller cancels it or the node stops."""
        if not request.stream_id or len(request.stream_id) > MAX_REQUEST_ID_LEN:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"stream_id must be 1 to {MAX_REQUEST_ID_LEN} characters")
        sink = self.sinks.open(request.stream_id)
        on_cancel(context, lambda: self.sinks.close(sink))
        try:
            for batch in sink.batches():
                yield pb.TokenBatch(
                    deltas=[
                        pb.TokenDelta(
                            request_id=d.request_id,
                            token_ids=d.token_ids,
                            logprobs=logprobs_pb(d.logprobs) if d.logprobs else (),
                        )
                        for d in batch
                    ]
                )
        finally:
            self.sinks.close(sink)

    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.ReserveResponse:
        if self.connector is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"decode node {self.cfg.node_id} has no transfer endpoint")
        self.refuse_if_draining(context)
        rid = self._request_id(request.request_id, context)
        params = self._params(request.sampling, context)
        ids = list(request.prompt_token_ids)
        lease = request.lease_s or self.cfg.reservation_lease_s
        images = images_of(request.images, context, need_data=False)
        try:
            got = self.loop_api(
                context, lambda: self.loop.reserve(rid, ids, params, transfer=lease, images=images).result()
            )
        except RequestIdInUse as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
            raise
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise
        except NoRoom as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            raise
        if not context.is_active():  # the caller went away meanwhile: nobody will fill or release it
            self._release(rid, "the caller went away before its reservation was answered", wait_s=0)
            context.abort(grpc.StatusCode.CANCELLED, f"reservation {rid}: the caller went away")
        res = got.reservation
        ranks: list[TargetRank] = res.transfer if isinstance(res.transfer, list) else []
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
                cached_blocks=res.cached_blocks,
            )
        )

    def _release(self, rid: str, reason: str, wait_s: float = 10.0) -> bool:
        """Release a reservation; wait (bounded) until its memory is back. False: none under that id."""
        try:
            done = self.loop.release(rid, reason)
        except ShuttingDown:
            return False
        if wait_s <= 0:
            return True
        try:
            done.result(wait_s)
        except (UnknownRequest, ShuttingDown):
            return False
        except FutureTimeout:
            log.warning("reservation %s: memory not back %.0f s after release (a write may be in flight)", rid, wait_s)
        return True

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        self.drop_dead_node(context, request.dead_prefill_node)
        if not request.request_id:
            return pb.ReleaseResponse(released=False)
        reason = request.reason or "released by the caller"
        return pb.ReleaseResponse(released=self.loop_api(context, lambda: self._release(request.request_id, reason)))


def serve(addr: str, cfg: DecodeNodeConfig) -> tuple[DecodeNode, int]:
    """Load the engine and serve on addr ("host:0" picks a port). Returns (node, port)."""
    return serve_node(DecodeNode(cfg), addr)
