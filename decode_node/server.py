"""The decode node's gRPC server: `serve(addr, cfg) -> (node, port)`.

Lifecycle: load the engine (t worker processes when tensor parallel), start the engine loop
thread (decode_node/loop.py), bind the gRPC server (DecodeNode + health + reflection), then
register with the router and heartbeat capacity. `node.stop()` reverses it: not serving,
heartbeats stop, in-flight streams end, engine workers exit.

Requests:
- Generate without a reservation: colocated; the engine prefills the prompt itself.
- Reserve / Release: KV pages for prompt + 1 tokens and a GDN slot set aside under a lease,
  for a prefill node to write into (needs EngineCore.reserve; the transfer endpoint that fills
  it and Generate(reserved=True) that activates it come with the prefill pool).
Client cancellation aborts the engine request, so pages and slot return to the free lists.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import grpc

from decode_node.config import DecodeNodeConfig
from decode_node.loop import EngineLoop, ShuttingDown, Stream
from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from proto import pb, rpc
from proto.serving import MAX_REQUEST_ID_LEN, Heartbeater, sampling_kwargs, start_server

log = logging.getLogger("pdserve.decode")


def new_incarnation() -> int:
    return int.from_bytes(os.urandom(7), "little")


def _digest(ecfg) -> str:
    try:
        from transfer.schema import model_digest

        return model_digest(ecfg).fingerprint()
    except Exception:  # the transfer layer is optional for a colocated node
        return ""


class DecodeNode(rpc.DecodeNodeServicer):
    def __init__(self, cfg: DecodeNodeConfig):
        self.cfg = cfg
        self.incarnation = new_incarnation()
        self.ecfg = cfg.engine_config()
        self.engine = EngineCore(self.ecfg)
        self.loop = EngineLoop(self.engine, name=f"{cfg.node_id}-engine").start()
        self.digest = _digest(self.ecfg)
        self.address = ""
        self.server: grpc.Server | None = None
        self._health = None
        self._hb: Heartbeater | None = None
        self._leases: dict[str, float] = {}  # reserved request id -> deadline (monotonic)
        self._lease_lock = threading.Lock()
        self._stopped = threading.Event()
        self._reaper = threading.Thread(target=self._reap_leases, name="leases", daemon=True)

    # ---- info ---------------------------------------------------------------------------
    def capacity(self) -> pb.Capacity:
        s = self.loop.snapshot
        return pb.Capacity(
            total_blocks=s.total_blocks,
            free_blocks=s.free_blocks,
            block_size=s.block_size,
            total_slots=s.total_slots,
            free_slots=s.free_slots,
            running=s.running,
            waiting=s.waiting,
            queued_prefill_tokens=s.queued_prefill_tokens,
            reserved=s.reserved,
        )

    def info(self) -> pb.NodeInfo:
        return pb.NodeInfo(
            node_id=self.cfg.node_id,
            kind=pb.NODE_KIND_DECODE,
            address=self.address,
            incarnation=self.incarnation,
            tp_size=self.cfg.tensor_parallel_size,
            model=self.cfg.model,
            vocab_size=self.ecfg.model.vocab_size,
            max_model_len=self.ecfg.max_model_len,
            local_prefill_threshold=self.cfg.local_prefill_threshold,
            schema_digest=self.digest,
            capacity=self.capacity(),
        )

    # ---- RPCs ---------------------------------------------------------------------------
    def Stats(self, request, context):
        return self.info()

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
            # Seam for the prefill pool: wait for the transfer into the reservation, then
            # EngineCore.activate(request_id, first_token_id) and stream like below.
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "decoding from a reservation needs the transfer (not wired yet)"
            )
        rid = self._request_id(request.request_id, context)
        params = self._params(request.sampling, context)
        stream = self.loop.submit(rid, list(request.prompt_token_ids), params)
        context.add_callback(lambda: self.loop.abort(stream))  # prompt, even while _relay waits
        try:
            yield from self._relay(stream, context)
        finally:  # however the call ends; a no-op for a finished request
            self.loop.abort(stream)

    def _relay(self, s: Stream, context):
        first_tok = last_tok = None
        n = 0
        first_msg = True
        while True:
            try:
                kind, item = s.get(timeout=1.0)
            except Exception:  # queue.Empty: check the client and the loop are still there
                if not context.is_active() or not self.loop.thread.is_alive():
                    return
                continue
            if kind == "error":
                if isinstance(item, ValueError):
                    code = grpc.StatusCode.INVALID_ARGUMENT
                elif isinstance(item, ShuttingDown):
                    code = grpc.StatusCode.UNAVAILABLE
                else:
                    code = grpc.StatusCode.INTERNAL
                context.abort(code, str(item))
            now = time.monotonic()
            new = item.new_token_ids
            if new:
                first_tok = first_tok if first_tok is not None else now
                last_tok = now
                n += len(new)
            done = item.finished
            t = pb.Timings()
            if first_tok is not None:
                t.ttft_s = first_tok - s.received
            if s.added is not None:
                t.queue_s = s.added - s.received
            if done:
                t.e2e_s = now - s.received
                if n > 1:
                    t.tpot_s = (last_tok - first_tok) / (n - 1)
            msg = pb.GenerateResponse(
                request_id=s.request_id,
                token_ids=new,
                finish_reason=item.finish_reason or "" if done else "",
                timings=t,
            )
            if first_msg:
                msg.prompt_tokens = s.num_prompt_tokens
                msg.decode_node = self.cfg.node_id
                first_msg = False
            if new or done:
                yield msg
            if done:
                log.info(
                    "request %s: prompt %d, output %d, %s; queue %.1f ms, ttft %.1f ms, tpot %.1f ms, e2e %.1f ms",
                    s.request_id, s.num_prompt_tokens, n, item.finish_reason,
                    t.queue_s * 1e3, t.ttft_s * 1e3, t.tpot_s * 1e3, t.e2e_s * 1e3,
                )  # fmt: skip
                return

    def Reserve(self, request, context):
        if not hasattr(self.engine, "reserve"):
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this engine has no reservations (EngineCore.reserve)")
        rid = self._request_id(request.request_id, context)
        params = self._params(request.sampling, context)
        ids = list(request.prompt_token_ids)
        try:
            got = self.loop.call(lambda e: e.reserve(ids, params, rid))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if got is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV pages or state slot for this prompt now")
        blocks, slot = got
        lease = request.lease_s or self.cfg.reservation_lease_s
        with self._lease_lock:
            self._leases[rid] = time.monotonic() + lease
        # Seam: one TargetRank per worker rank, with that rank's transfer agent name.
        ranks = [
            pb.TargetRank(agent="", rank=r, block_ids=blocks, slot=slot, incarnation=self.incarnation)
            for r in range(self.cfg.tensor_parallel_size)
        ]
        return pb.ReserveResponse(
            target=pb.TransferTarget(
                request_id=rid,
                node_id=self.cfg.node_id,
                tp_size=self.cfg.tensor_parallel_size,
                schema_digest=self.digest,
                num_tokens=len(ids),
                ranks=ranks,
                lease_s=lease,
            )
        )

    def _release(self, rid: str) -> bool:
        with self._lease_lock:
            held = self._leases.pop(rid, None) is not None
        if held:
            self.loop.call(lambda e: e.release(rid))
        return held

    def Release(self, request, context):
        return pb.ReleaseResponse(released=self._release(request.request_id))

    def _reap_leases(self) -> None:
        while not self._stopped.wait(0.5):
            now = time.monotonic()
            with self._lease_lock:
                expired = [r for r, d in self._leases.items() if d <= now]
            for rid in expired:
                log.warning("reservation %s: lease expired, released", rid)
                self._release(rid)

    def Handshake(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "the transfer endpoint is not wired on decode nodes yet")

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self, addr: str) -> int:
        self.server, port, self._health = start_server(
            addr, lambda s: rpc.add_DecodeNodeServicer_to_server(self, s), ["DecodeNode"]
        )
        self.address = f"{self.cfg.advertise_host}:{port}"
        self._reaper.start()
        if self.cfg.router:
            self._hb = Heartbeater(self.cfg.router, self.info, self.cfg.heartbeat_interval_s).start()
        log.info("decode node %s serving on %s (%s)", self.cfg.node_id, self.address, self.engine.capacity.summary())
        return port

    def stop(self, grace: float | None = 2.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        if self._hb is not None:
            self._hb.stop()
        self.loop.stop()
        if self.server is not None:
            self.server.stop(grace).wait(timeout=(grace or 0) + 5)
        self.engine.close()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.server.wait_for_termination(timeout)


def serve(addr: str, cfg: DecodeNodeConfig) -> tuple[DecodeNode, int]:
    """Load the engine and serve on addr ("host:0" picks a port). Returns (node, port)."""
    node = DecodeNode(cfg)
    try:
        port = node.start(addr)
    except Exception:
        node.stop(0)
        raise
    return node, port
