"""The router: `serve(addr, cfg) -> (router, port)`.

Serves `Generation` (clients) and `Registry` (nodes), plus health and reflection. One request:

    validate (prompt, sampling) -> tokenize text -> admission (router/admission.py): FIFO, bounded
    by --admission-timeout and --max-queued-requests, until the policy finds a decode node D with
    room and, for the prefill pool, a prefill node P within its --prefill-window-tokens -> prefill
    phase -> stream D's tokens back, with text deltas and the router's timings -> one INFO line
    (with queue wait, transfer bytes and ms)

The prefill phase (router/prefill.py), when the prompt is at least D's local-prefill threshold
and a prefill node is ready and not overloaded, returns a Push: a reservation on D and the first
token from a prefill node P, which goes to the client at once while P's ranks still write the
state; then D.Generate(reserved=True, first_token_id) waits on D for every rank's state and
streams the rest. If the push fails, D's call ends ABORTED and the client gets the push's error.
Otherwise D prefills locally (colocated).

A client that cancels cancels the upstream calls: the prefill node aborts the push, the
reservation is released, the decode node aborts the request. If the chosen decode node is
unreachable before the first token, the request is tried once more on another node. A
background thread sweeps heartbeats (router/registry.py).

Draining: a node that refuses a call with `pdserve-draining` (proto/serving.py) is marked
draining, not dead: its in-flight requests and transfers go on, and the request is placed
elsewhere (another decode node; another prefill node, else the decode node prefills). The
router drains too (`drain`, on SIGTERM): new Generate calls get UNAVAILABLE + `pdserve-draining`
while the ones in flight finish.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from prometheus_client import Counter, Histogram

from proto import pb, rpc
from proto.metrics import ServingMetrics
from proto.serving import (
    MAX_REQUEST_ID_LEN,
    is_draining,
    not_serving,
    refuse_draining,
    sampling_kwargs,
    start_server,
    wait_idle,
)
from router.admission import Admission
from router.config import RouterConfig
from router.detok import IncrementalDetokenizer
from router.errors import Abort, DecodeFailed
from router.policy import make_policy
from router.prefill import PrefillPhase
from router.registry import NodeEntry, NodeRegistry
from router.stops import with_stops

log = logging.getLogger("pdserve.router")

# Every Generate call holds a server thread while it waits for admission or streams: the router
# takes up to max_queued_requests + STREAMING of them (more are refused RESOURCE_EXHAUSTED at once)
# and keeps SPARE_THREADS beyond that for heartbeats, registration and health checks, which must
# never wait behind client requests under overload.
STREAMING = 1024
SPARE_THREADS = 64


@dataclass
class _Trace:
    """What the per-request log line reports."""

    request_id: str
    received: float = field(default_factory=time.monotonic)
    prompt_len: int = 0
    decode: str = "-"
    prefill: str = "local"
    queue_s: float = 0.0
    first: float | None = None
    last: float | None = None
    n: int = 0
    finish: str = "-"
    transfer_bytes: int = 0
    transfer_s: float = 0.0


class Router(rpc.GenerationServicer, rpc.RegistryServicer):
    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.registry = NodeRegistry(cfg.heartbeat_interval_s, cfg.dead_after_s)
        for a in cfg.static_decode:
            self.registry.add_static(a, pb.NODE_KIND_DECODE)
        for a in cfg.static_prefill:
            self.registry.add_static(a, pb.NODE_KIND_PREFILL)
        self.policy = make_policy(cfg.policy)
        self.prefill = PrefillPhase(cfg, self.registry, self.policy)
        self.tokenizer = None
        if cfg.model:
            from engine.tokenizer import Tokenizer

            if Tokenizer.exists(cfg.model):
                self.tokenizer = Tokenizer(cfg.model)
        self.server: grpc.Server | None = None
        self._health = None
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="sweeper", daemon=True)
        self._active = 0  # requests in Generate (under registry.cond)
        self.metrics = ServingMetrics("pdserve_router", self._gauges)
        reg = self.metrics.registry
        self.queue_wait = Histogram("pdserve_router_queue_wait_seconds", "Time requests waited for admission",
                                    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                    registry=reg)  # fmt: skip
        self.refused = Counter("pdserve_router_admission_refused",
                               "Requests refused RESOURCE_EXHAUSTED before any work: queue full, or no room in time",
                               ["reason"], registry=reg)  # fmt: skip
        for reason in ("queue_full", "timeout"):
            self.refused.labels(reason=reason)
        self.admission = Admission(self.registry.cond, cfg.max_queued_requests, cfg.admission_timeout_s,
                                   self._left_queue)  # fmt: skip
        self.generate_limit = (cfg.max_queued_requests or 4096) + STREAMING
        self.metrics_port: int | None = None
        self.http = None  # router.http.OpenAIServer when cfg.http_port is set
        self.http_port: int | None = None
        self.draining = False

    def _gauges(self) -> dict[str, tuple[str, float]]:
        dec = self.registry.live(pb.NODE_KIND_DECODE)
        caps = [e.info.capacity for e in dec]
        return {
            "queue_depth": ("Requests waiting for admission", self.admission.depth()),
            "active_requests": ("Requests in flight through the router", self._active),
            "decode_nodes_live": ("Live decode nodes", len(dec)),
            "prefill_nodes_live": ("Live prefill nodes", len(self.registry.live(pb.NODE_KIND_PREFILL))),
            "nodes_draining": ("Live nodes that drain (finish what they hold, take nothing new)",
                               sum(1 for e, _ in self.registry.snapshot() if e.alive and e.info.draining)),
            "kv_pages_free": ("KV pages free over live decode nodes (last heartbeat)",
                              sum(c.free_blocks for c in caps)),
            "kv_pages_used": ("KV pages in use over live decode nodes (last heartbeat)",
                              sum(c.total_blocks - c.free_blocks for c in caps)),
            "state_slots_free": ("State slots free over live decode nodes (last heartbeat)",
                                 sum(c.free_slots for c in caps)),
            "state_slots_used": ("State slots in use over live decode nodes (last heartbeat)",
                                 sum(c.total_slots - c.free_slots for c in caps)),
        }  # fmt: skip

    # ---- Registry ---------------------------------------------------------------------------
    def Register(self, request, context):
        if not request.node.node_id or not request.node.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node_id and address are required")
        self.registry.register(request.node)
        return pb.RegisterResponse(heartbeat_interval_s=self.cfg.heartbeat_interval_s)

    def Heartbeat(self, request, context):
        return pb.HeartbeatResponse(
            known=self.registry.heartbeat(request.node_id, request.incarnation, request.capacity, request.draining)
        )

    def ListNodes(self, request, context):
        return pb.ListNodesResponse(
            nodes=[
                pb.NodeStatus(node=e.info, alive=e.alive, last_seen_s=age, static=e.static)
                for e, age in self.registry.snapshot()
            ]
        )

    def _sweep(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_interval_s):
            try:
                self.registry.sweep()
            except Exception:
                log.exception("registry sweep failed")

    # ---- Generation -------------------------------------------------------------------------
    def ListModels(self, request, context):
        seen: dict[str, pb.ModelInfo] = {}
        for e, _ in self.registry.snapshot():
            if e.alive and e.info.model and e.info.model not in seen:
                seen[e.info.model] = pb.ModelInfo(
                    id=Path(e.info.model).name,
                    path=e.info.model,
                    vocab_size=e.info.vocab_size,
                    max_model_len=e.info.max_model_len,
                    has_tokenizer=self.tokenizer is not None,
                )
        return pb.ListModelsResponse(models=list(seen.values()))

    def _prompt_ids(self, request) -> list[int]:
        if request.prompt and request.prompt_token_ids:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "give prompt text or prompt_token_ids, not both")
        if request.prompt:
            if self.tokenizer is None:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "this router has no tokenizer: send prompt_token_ids")
            ids = self.tokenizer.encode(request.prompt)
        else:
            ids = list(request.prompt_token_ids)
        if not ids:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt: give at least one token")
        return ids

    def _check(self, request, ids: list[int]) -> None:
        from engine.sampling_params import SamplingParams

        try:
            SamplingParams(**sampling_kwargs(request.sampling))
        except ValueError as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if request.sampling.stop and self.tokenizer is None:
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT, "stop strings need a tokenizer on the router: use stop_token_ids"
            )
        if len(request.request_id) > MAX_REQUEST_ID_LEN:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id longer than {MAX_REQUEST_ID_LEN} characters")
        nodes = self.registry.live(pb.NODE_KIND_DECODE)
        if nodes:  # refuse what no node could ever take, rather than queueing it
            limit = max(e.info.max_model_len for e in nodes)
            if len(ids) >= limit:
                raise Abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"prompt of {len(ids)} tokens leaves no room to generate: max_model_len is {limit}",
                )
            most = max(e.info.capacity.total_blocks for e in nodes)
            need = nodes[0].blocks_for(len(ids) + 1)
            if need > most:
                raise Abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"prompt of {len(ids)} tokens needs {need} KV blocks; the largest decode node holds {most}",
                )
            vocab = min(e.info.vocab_size for e in nodes)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt token id(s) {bad[:5]} out of range [0, {vocab})")

    def _left_queue(self, outcome: str, wait_s: float) -> None:
        if outcome in ("queue_full", "timeout"):
            self.refused.labels(reason=outcome).inc()
        if outcome != "queue_full":
            self.queue_wait.observe(wait_s)

    def _admit(
        self, prompt_len: int, context, exclude: set[str], local: bool = False
    ) -> tuple[NodeEntry, NodeEntry | None]:
        """Wait in the admission queue until the request is placed: (decode node, prefill node or
        None to prefill on the decode node), both counted against (router/admission.py).
        local: prefill on the decode node (logprobs: the prefill node does not return them)."""

        def refuse() -> Abort:
            if not [e for e in self.registry.routable(pb.NODE_KIND_DECODE) if e.node_id not in exclude]:
                return Abort(grpc.StatusCode.UNAVAILABLE, "no live decode node takes new requests")
            return Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no decode node had room (or no prefill node was within its window) for a {prompt_len}-token "
                f"prompt within {self.cfg.admission_timeout_s:g} s ({self.admission.depth()} in the admission queue): "
                "try again later",
            )

        return self.admission.wait(lambda: self._place(prompt_len, exclude, local), context, refuse)

    def _place(
        self, prompt_len: int, exclude: set[str], local: bool = False
    ) -> tuple[NodeEntry, NodeEntry | None] | None:
        """Under registry.cond: a decode node with room and, when the prompt goes through the
        prefill pool, a prefill node within its window; None: not now."""
        nodes = [e for e in self.registry.routable(pb.NODE_KIND_DECODE) if e.node_id not in exclude]
        d = self.policy.choose_decode(nodes, prompt_len)
        if d is None:
            return None
        p = None
        if not local and self.prefill.use_pool(d, prompt_len):
            p = self.prefill.choose(d, prompt_len, set(), window=True)
            if p is None:
                return None  # every prefill node has its window of work: wait, reserving nothing
        d.inflight += 1
        d.inflight_blocks += d.blocks_for(prompt_len + 1)
        return d, p

    def _done(self, e: NodeEntry, prompt_len: int) -> None:
        with self.registry.cond:
            e.inflight -= 1
            e.inflight_blocks -= e.blocks_for(prompt_len + 1)
            e.freed_slots += 1
            e.freed_blocks += e.blocks_for(prompt_len + 1)
            self.registry.cond.notify_all()

    def Generate(self, request, context):
        if self.draining:
            refuse_draining(context, "the router")
        tr = _Trace(request.request_id or uuid.uuid4().hex)
        with self.registry.cond:
            full = self._active >= self.generate_limit
            if not full:
                self._active += 1
        if full:
            self._left_queue("queue_full", 0.0)
            log.info(
                "request %s: refused RESOURCE_EXHAUSTED, %d requests in flight", tr.request_id, self.generate_limit
            )
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the router has {self.generate_limit} requests in flight, its limit: try again later",
            )
        try:
            ids = self._prompt_ids(request)
            tr.prompt_len = len(ids)
            self._check(request, ids)
            stream = self._generate(request, ids, tr, context)
            yield from with_stops(stream, list(request.sampling.stop), request.sampling.min_tokens,
                                  lambda: setattr(tr, "finish", "stop"))  # fmt: skip
        except Abort as a:
            tr.finish = a.code.name
            context.abort(a.code, a.msg)
        except GeneratorExit:  # the client went away between messages
            tr.finish = "cancelled"
            raise
        finally:
            self._log(tr)
            self._count(tr)
            with self.registry.cond:
                self._active -= 1

    def _count(self, tr: _Trace) -> None:
        if tr.finish in ("stop", "length"):
            outcome = "ok"
        elif tr.finish in ("cancelled", "abort", "CANCELLED", "-"):
            outcome = "cancelled"
        else:
            outcome = "error"
        ttft = tr.first - tr.received if tr.first else None
        tpot = (tr.last - tr.first) / (tr.n - 1) if tr.n > 1 else None
        self.metrics.request_done(outcome, ttft, tpot, tr.n)
        if tr.transfer_bytes:
            self.metrics.transfer_done(tr.transfer_bytes, tr.transfer_s)

    def _generate(self, request, ids: list[int], tr: _Trace, context):
        detok = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer is not None else None
        tried: set[str] = set()
        while True:
            t_admit = time.monotonic()
            sp = request.sampling
            d, p = self._admit(len(ids), context, tried, sp.HasField("logprobs") or sp.HasField("prompt_logprobs"))
            tr.queue_s += time.monotonic() - t_admit
            tr.decode = d.node_id
            tried.add(d.node_id)
            pre = None
            call = None
            settled = False  # the reservation (if any) is activated, released or never made
            try:
                if p is not None:
                    pre = self.prefill.run(d, p, request, ids, tr.request_id, context)
                if pre is None:
                    tr.prefill = "local"
                    call = d.stub.Generate(
                        pb.DecodeRequest(request_id=tr.request_id, prompt_token_ids=ids, sampling=request.sampling)
                    )
                else:
                    resp = pre.first
                    tr.prefill = pre.p.node_id
                    # the first token goes to the client at once, while the push runs
                    m = pb.GenerateResponse(token_ids=[resp.first_token_id], finish_reason=resp.finish_reason)
                    m.timings.CopyFrom(resp.timings)
                    yield self._relay_msg(m, tr, detok, pre, first=True)
                    if resp.finish_reason:  # the first token ended it: nothing was pushed
                        settled = True
                        self.prefill.release(d, pre.rid, "finished at the first token")
                        return
                    # D waits for every rank's state, then decodes
                    call = d.stub.Generate(
                        pb.DecodeRequest(
                            request_id=pre.rid, prompt_token_ids=ids, sampling=request.sampling, reserved=True,
                            first_token_id=resp.first_token_id, draft_token_ids=resp.draft_token_ids,
                        )
                    )  # fmt: skip
                context.add_callback(call.cancel)
                first = pre is None
                for m in call:
                    settled = True  # D activated the reservation (or failed and released it)
                    yield self._relay_msg(m, tr, detok, pre, first=first)
                    first = False
                settled = True
                return
            except DecodeFailed as df:
                e = df.err
                code = e.code()
                if self._placed_elsewhere(e, d, tr):
                    continue
                others = [n for n in self.registry.routable(pb.NODE_KIND_DECODE) if n.node_id not in tried]
                if code == grpc.StatusCode.UNAVAILABLE and tr.n == 0 and len(tried) < 2 and others:
                    log.warning("request %s: decode node %s unavailable, retrying elsewhere", tr.request_id, d.node_id)
                    continue
                raise Abort(code, e.details() or code.name) from None
            except grpc.RpcError as e:
                if not context.is_active():  # the client went away; the callback cancelled upstream
                    tr.finish = "cancelled"
                    return
                code = e.code()
                if self._placed_elsewhere(e, d, tr):
                    continue
                if pre is not None and code == grpc.StatusCode.ABORTED and pre.done.wait(5.0) and pre.error is not None:
                    pe = pre.error  # D gave up because the push failed: report why
                    raise Abort(pe.code(), f"pushing the state from {pre.p.node_id} failed: "
                                 f"{pe.details() or pe.code().name}") from None  # fmt: skip
                others = [n for n in self.registry.routable(pb.NODE_KIND_DECODE) if n.node_id not in tried]
                if code == grpc.StatusCode.UNAVAILABLE and tr.n == 0 and len(tried) < 2 and others:
                    log.warning("request %s: decode node %s unavailable, retrying elsewhere", tr.request_id, d.node_id)
                    continue
                raise Abort(code, e.details() or code.name) from None
            finally:
                if call is not None:
                    call.cancel()  # no-op when it completed; stops the node's work otherwise
                if pre is not None:
                    if not settled:  # ended between the prefill and decode: free it now
                        self.prefill.release(d, pre.rid, "the request ended before decode began")
                    if not pre.done.is_set():
                        pre.call.cancel()  # the request is over: the prefill node aborts what is left
                self._done(d, len(ids))

    def _placed_elsewhere(self, e: grpc.RpcError, d: NodeEntry, tr: _Trace) -> bool:
        """D refused the request because it drains (before any token): place it on another node."""
        if tr.n or not is_draining(e):
            return False
        self.registry.mark_draining(d)
        log.info("request %s: decode node %s is draining, placing it elsewhere", tr.request_id, d.node_id)
        return True

    def _relay_msg(self, m, tr: _Trace, detok, pre, first: bool) -> pb.GenerateResponse:
        now = time.monotonic()
        if m.token_ids:
            tr.first = tr.first or now
            tr.last = now
            tr.n += len(m.token_ids)
        out = pb.GenerateResponse(request_id=tr.request_id, token_ids=m.token_ids, finish_reason=m.finish_reason,
                                  logprobs=m.logprobs, prompt_logprobs=m.prompt_logprobs)  # fmt: skip
        if detok is not None and (m.token_ids or m.finish_reason):
            out.text = detok.push(list(m.token_ids), final=bool(m.finish_reason))
        if first:
            out.prompt_tokens = tr.prompt_len
            out.decode_node = tr.decode
            out.prefill_node = "" if pre is None else pre.p.node_id
            out.cached_tokens = m.cached_tokens if pre is None else pre.first.cached_tokens
        self._timings(out.timings, m.timings, tr, now, done=bool(m.finish_reason))
        if pre is not None:  # the transfer figures, complete on the last message
            t = pre.timings(wait_s=5.0 if m.finish_reason and not first else 0.0)
            out.timings.prefill_s, out.timings.transfer_s, out.timings.transfer_bytes = (
                t.prefill_s, t.transfer_s, t.transfer_bytes,
            )  # fmt: skip
        if m.finish_reason:
            tr.finish = m.finish_reason
            tr.transfer_bytes, tr.transfer_s = out.timings.transfer_bytes, out.timings.transfer_s
        return out

    @staticmethod
    def _timings(t: pb.Timings, node: pb.Timings, tr: _Trace, now: float, done: bool) -> None:
        t.queue_s = tr.queue_s + node.queue_s
        t.prefill_s, t.transfer_s, t.transfer_bytes = node.prefill_s, node.transfer_s, node.transfer_bytes
        if tr.first is not None:
            t.ttft_s = tr.first - tr.received
        if done:
            t.e2e_s = now - tr.received
            if tr.n > 1:
                t.tpot_s = (tr.last - tr.first) / (tr.n - 1)

    @staticmethod
    def _log(tr: _Trace) -> None:
        ttft = f"{(tr.first - tr.received) * 1e3:.1f} ms" if tr.first else "-"
        tpot = f"{(tr.last - tr.first) / (tr.n - 1) * 1e3:.1f} ms" if tr.n > 1 else "-"
        log.info(
            "request %s: prompt %d, decode %s, prefill %s, queue %.1f ms, ttft %s, tpot %s, %d tokens, %s; "
            "transfer %d B in %.1f ms",
            tr.request_id, tr.prompt_len, tr.decode, tr.prefill, tr.queue_s * 1e3, ttft, tpot, tr.n, tr.finish,
            tr.transfer_bytes, tr.transfer_s * 1e3,
        )  # fmt: skip

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, addr: str) -> int:
        def add(s):
            rpc.add_GenerationServicer_to_server(self, s)
            rpc.add_RegistryServicer_to_server(self, s)

        self.server, port, self._health = start_server(
            addr, add, ["Generation", "Registry"], max_workers=self.generate_limit + SPARE_THREADS
        )
        self._sweeper.start()
        log.info("router serving on port %d (policy %s)", port, self.policy.name)
        host = self.cfg.host
        if self.cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(host, self.cfg.metrics_port)
            log.info("router metrics at http://%s:%d/metrics", host, self.metrics_port)
        if self.cfg.http_port is not None:
            from router.http import OpenAIServer

            self.http = OpenAIServer(self, f"127.0.0.1:{port}")
            self.http_port = self.http.start(host, self.cfg.http_port)
            log.info("router OpenAI-compatible HTTP at http://%s:%d/v1", host, self.http_port)
        return port

    def drain(self, timeout_s: float, interrupt: threading.Event | None = None) -> bool:
        """Refuse new Generate calls (UNAVAILABLE, `pdserve-draining`; readiness NOT_SERVING) and
        wait, at most timeout_s or until `interrupt` is set, for those in flight. True: none left."""
        if not self.draining:
            self.draining = True
            not_serving(self._health, "Generation")
        return wait_idle("router", lambda: self._active, timeout_s, interrupt)

    def stop(self, grace: float | None = 2.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        if self.http is not None:
            self.http.stop()
        self.metrics.stop()
        if self.server is not None:
            self.server.stop(grace).wait(timeout=(grace or 0) + 5)
        self.registry.close()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.server.wait_for_termination(timeout)


__all__ = ["Router", "RouterConfig", "serve"]


def serve(addr: str, cfg: RouterConfig) -> tuple[Router, int]:
    router = Router(cfg)
    return router, router.start(addr)
