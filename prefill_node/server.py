"""The prefill node's gRPC server, `serve(addr, cfg) -> (node, port)`: maps Prefill, Abort and
Handshake to the engine loop (serving/loop.py). Its requests are prefill-only: the engine holds
the prompt's pages and GDN slot, and its connector (transfer/connector/prefill.py) pushes them to
the decode node's reservation. Lifecycle and drain: docs/serving.md, "Module notes"."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator

import grpc

from engine.connector import SendDone
from engine.core import EngineCore
from engine.outputs import RequestOutput
from engine.request import RequestIdInUse
from engine.sampling_params import SamplingParams
from engine.vision.inputs import ImageInput
from prefill_node.config import PrefillNodeConfig
from prefill_node.encoded import EncodedInputs
from proto import pb, rpc
from proto.convert import logprobs_pb, sampling_kwargs
from serving.commands import LoopError, RequestHandle, ShuttingDown, UnknownRequest
from serving.loop import EngineLoop
from serving.metrics import ServingMetrics, capacity_gauges
from serving.node import NodeServer, on_cancel, serve_node
from serving.rpc import MAX_REQUEST_ID_LEN, images_of
from serving.vllm_metrics import register_node as register_vllm
from transfer import TransferConfig
from transfer.connector import PrefillConnector, PushParams
from transfer.messages import Target, TargetRank
from transfer.schema import feeds

log = logging.getLogger("pdserve.prefill")


def _target(t: pb.TransferTarget) -> Target:
    ranks = sorted(
        (TargetRank(r.agent, r.rank, list(r.block_ids), r.slot, r.incarnation) for r in t.ranks), key=lambda r: r.rank
    )
    return Target(t.request_id, t.node_id, t.tp_size, t.schema_digest, t.num_tokens, ranks, t.cached_blocks)


class PrefillNode(NodeServer, rpc.PrefillNodeServicer):
    KIND = "prefill"
    SERVICE = "PrefillNode"
    NODE_KIND = pb.NODE_KIND_PREFILL
    cfg: PrefillNodeConfig
    connector: PrefillConnector | None

    def __init__(self, cfg: PrefillNodeConfig) -> None:
        self._init_lifecycle()
        self.cfg = cfg
        # its steps compute prompts: no decode step to capture CUDA graphs for at start-up
        self.ecfg = dataclasses.replace(cfg.engine_config(), cuda_graphs=False)
        self.incarnation = int.from_bytes(os.urandom(7), "little")
        self.backend = cfg.transfer_backend
        self.engine = EngineCore(self.ecfg)
        try:
            self.connector = PrefillConnector(
                self.engine.executor,
                cfg.node_id,
                TransferConfig(
                    backend=self.backend,
                    bind_host=cfg.data_host,
                    allow_tcp_staging=cfg.allow_tcp_staging,
                    staging_slots=cfg.transfer_staging_slots,
                ),
                push_timeout_s=cfg.push_timeout_s,
                spin_s=cfg.push_spin_s,
                stream=cfg.stream_kv,
                by_layer=cfg.kv_by_layer,
            )
        except Exception:
            self.engine.close()
            raise
        self.engine.use_connector(self.connector)
        self.digest = self.connector.digest
        self._lock = threading.Lock()
        self._calls: set[str] = set()  # request ids a Prefill call is serving (guarded by _lock)
        self.loop = EngineLoop(self.engine, name=f"{cfg.node_id}-engine", on_change=self.changes.changed).start()
        self.metrics = ServingMetrics("pdserve_prefill", lambda: capacity_gauges(self.loop.snapshot))
        register_vllm(self.metrics.registry, cfg.model, cfg.served_model_name, lambda: self.loop.snapshot)
        try:
            self.encoded = EncodedInputs(cfg, self.ecfg, self.loop, self.metrics)
        except Exception:
            self.loop.stop()
            self.connector.close()
            self.engine.close()
            raise

    # ---- info ---------------------------------------------------------------------------------
    def _describe(self, info: pb.NodeInfo) -> None:
        info.prefill_ready = True

    def in_flight(self) -> int:
        s = self.loop.snapshot
        with self._lock:
            calls = len(self._calls)
        return max(calls, s.running + s.waiting + s.transfer.in_flight)

    def _add_servicer(self, server: grpc.Server) -> None:
        rpc.add_PrefillNodeServicer_to_server(self, server)

    def _close(self) -> None:
        self.encoded.close()
        super()._close()

    # ---- the encode pool --------------------------------------------------------------------------
    def ReserveEncoded(
        self, request: pb.ReserveEncodedRequest, context: grpc.ServicerContext
    ) -> pb.ReserveEncodedResponse:
        """Which of the images the encoder cache holds; landing slots for the others."""
        self.refuse_if_draining(context)
        return self.encoded.reserve(request, context)

    # ---- Prefill ------------------------------------------------------------------------------
    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> Iterator[pb.PrefillResponse]:
        self.refuse_if_draining(context)
        rid = request.request_id
        if not rid or len(rid) > MAX_REQUEST_ID_LEN:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id must have 1..{MAX_REQUEST_ID_LEN} characters")
        # a request that ends at its first token (max_tokens 1) needs no decode node: no target
        alone = not request.HasField("target") and request.sampling.HasField("max_tokens")
        alone = alone and request.sampling.max_tokens == 1
        if not alone and (not request.HasField("target") or not request.target.ranks):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a TransferTarget with every destination rank is required (none only with max_tokens 1)",
            )
        if not alone and request.target.num_tokens != len(request.prompt_token_ids):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"target reserved for {request.target.num_tokens} tokens, the prompt has "
                f"{len(request.prompt_token_ids)}",
            )
        if not alone and not feeds(self.digest, request.target.schema_digest):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"target model digest {request.target.schema_digest} differs from this node's {self.digest}",
            )
        try:
            params = SamplingParams(**sampling_kwargs(request.sampling))  # type: ignore[no-untyped-call]  # its **kwargs init
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        push = None if alone else PushParams(_target(request.target), max(0.0, request.target.lease_s))
        ids = list(request.prompt_token_ids)
        images = images_of(
            request.images, context, model=self.ecfg.model.path if request.images and self.ecfg.model.vision else None
        )
        t0 = time.monotonic()
        with self._lock:
            taken = rid in self._calls
            self._calls.add(rid)
        if taken:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already in flight here")
        outcome = "error"
        try:
            self.loop_api(context, lambda: self.encoded.take(rid, images, request.encoded))
            self.encoded.note(images)
            for resp in self._prefill(rid, ids, params, push, t0, context, images):
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
            with self._lock:
                self._calls.discard(rid)
            self.changes.changed()  # in_flight() counts the calls: wake a drain

    def _prefill(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        push: PushParams | None,
        t0: float,
        context: grpc.ServicerContext,
        images: tuple[ImageInput, ...] = (),
    ) -> Iterator[pb.PrefillResponse]:
        """Yields the first-token message at once, then (state pushed) the `pushed` message. No
        push (a request ending at its first token): the first message only."""
        target = push.target if push is not None else None
        handle = self.loop_api(
            context,
            lambda: self.loop.submit(rid, ids, params, prefill_only=push is not None, transfer=push, images=images),
        )
        # the call ended (the caller cancelled, or it is over): aborts the request before its
        # first token, its push after; a no-op once both are over
        on_cancel(context, handle.abort)
        out = self._first(handle, context)
        if out is None:
            context.abort(grpc.StatusCode.CANCELLED, f"request {rid} cancelled before its first token")
        t_first = time.monotonic()
        first = out.output_token_ids[0] if out.output_token_ids else -1
        added = handle.added or t0
        t = pb.Timings(queue_s=added - t0, prefill_s=t_first - added, ttft_s=t_first - t0)
        if out.finish_reason != "prefilled" or target is None:
            if out.finish_reason not in ("stop", "length"):
                context.abort(
                    grpc.StatusCode.ABORTED, f"request {rid} ended before its first token ({out.finish_reason})"
                )
            self._log(rid, len(ids), first, t, out.finish_reason or "", target, out.num_cached_tokens)
            yield pb.PrefillResponse(
                first_token_id=first,
                timings=t,
                finish_reason=out.finish_reason,
                cached_tokens=out.num_cached_tokens,
                logprobs=logprobs_pb(out.logprobs or ()),
            )
            return
        # the first token (its logprobs when asked, MTP drafts), while the push runs
        yield pb.PrefillResponse(
            first_token_id=first,
            timings=t,
            draft_token_ids=out.draft_token_ids,
            cached_tokens=out.num_cached_tokens,
            logprobs=logprobs_pb(out.logprobs or ()),
        )
        if not context.is_active():
            handle.abort()
        # the push ends (done and quiet, or failed) within its timeout; the wait's is a backstop
        try:
            done = handle.wait_transfer(self.cfg.push_timeout_s + 30)
        except ShuttingDown:
            done = SendDone(rid, "the prefill node is shutting down")
        except TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid}: the push never settled")
        if done is None:
            context.abort(grpc.StatusCode.INTERNAL, f"request {rid}: its push did not start")
        t.transfer_s = done.seconds
        t.transfer_bytes = done.nbytes
        self.metrics.transfer_done(done.nbytes, done.seconds, ok=done.error is None)
        if done.error is not None:
            code = grpc.StatusCode.CANCELLED if done.aborted else grpc.StatusCode.ABORTED
            self._log(rid, len(ids), first, t, f"push failed: {done.error}", target, out.num_cached_tokens)
            context.abort(code, f"request {rid}: pushing the state to {target.node} failed: {done.error}")
        self._log(rid, len(ids), first, t, "pushed", target, out.num_cached_tokens)
        yield pb.PrefillResponse(first_token_id=first, timings=t, pushed=True)

    def _first(self, handle: RequestHandle, context: grpc.ServicerContext) -> RequestOutput | None:
        """The request's finished output (prefilled or ended), or None when aborted / cancelled."""
        try:
            for out in handle:  # blocks on the handle; a cancel aborts it, a stop fails it
                if out.finished:
                    return None if out.finish_reason == "abort" else out
        except ShuttingDown as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except RequestIdInUse as e:  # its id is still held here (a push not quiet yet)
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except LoopError:  # aborted by id with nothing left in the engine
            return None
        except Exception as e:
            context.abort(grpc.StatusCode.INTERNAL, str(e))
        return None

    def _log(
        self, rid: str, n: int, first: int, t: pb.Timings, what: str, target: Target | None, cached: int = 0
    ) -> None:
        log.info(
            "request %s: prompt %d (cached %d) -> %s, first token %d, %s; queue %.1f ms, prefill %.1f ms, "
            "transfer %d B in %.1f ms",
            rid, n, cached, target.node if target is not None else "-", first, what, t.queue_s * 1e3, t.prefill_s * 1e3, t.transfer_bytes, t.transfer_s * 1e3,
        )  # fmt: skip

    # ---- Abort ------------------------------------------------------------------------------------
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        """Abort the request still computing its prompt, or its push (opened or running)."""
        reason = request.reason or "aborted by the router"
        self.drop_dead_node(context, request.dead_decode_node)
        if not request.request_id:
            return pb.AbortResponse(aborted=False)
        try:
            self.loop_api(context, lambda: self.loop.abort(request.request_id, reason).result(30))
        except UnknownRequest:
            return pb.AbortResponse(aborted=False)
        return pb.AbortResponse(aborted=True)


def serve(addr: str, cfg: PrefillNodeConfig) -> tuple[PrefillNode, int]:
    return serve_node(PrefillNode(cfg), addr)
