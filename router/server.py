"""The router: `serve(addr, cfg) -> (router, port)`.

Serves `Generation` (clients) and `Registry` (nodes), plus health and reflection. One request:

    validate (prompt, sampling) -> tokenize text -> admission: wait (bounded) until the policy
    finds a decode node with room -> [prefill phase: seam, see _prefill] -> stream the decode
    node's tokens back, with text deltas and the router's timings -> one INFO line

A client that cancels cancels the upstream call, and the decode node aborts the request.
If the chosen decode node is unreachable before the first token, the request is tried once
more on another node. A background thread sweeps heartbeats (router/registry.py).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from proto import pb, rpc
from proto.serving import MAX_REQUEST_ID_LEN, sampling_kwargs, start_server
from router.detok import IncrementalDetokenizer
from router.policy import make_policy
from router.registry import NodeEntry, NodeRegistry

log = logging.getLogger("pdserve.router")


@dataclass(frozen=True)
class RouterConfig:
    model: str | None = None  # checkpoint directory: its tokenizer serves text prompts
    static_decode: tuple[str, ...] = ()  # decode node addresses polled with Stats
    static_prefill: tuple[str, ...] = ()  # prefill node addresses polled with Stats
    heartbeat_interval_s: float = 0.5  # what nodes are told to use
    dead_after_s: float = 3.0  # no heartbeat for this long: the node is dead
    admission_timeout_s: float = 30.0  # wait this long for room, then RESOURCE_EXHAUSTED
    policy: str = "least-loaded"

    def __post_init__(self):
        if self.dead_after_s <= self.heartbeat_interval_s:
            raise ValueError("dead_after_s must exceed heartbeat_interval_s")
        if self.admission_timeout_s < 0:
            raise ValueError("admission_timeout_s must be >= 0")
        make_policy(self.policy)


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, msg: str):
        super().__init__(msg)
        self.code, self.msg = code, msg


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
        self.tokenizer = None
        if cfg.model:
            from engine.tokenizer import Tokenizer

            if Tokenizer.exists(cfg.model):
                self.tokenizer = Tokenizer(cfg.model)
        self.server: grpc.Server | None = None
        self._health = None
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="sweeper", daemon=True)

    # ---- Registry ---------------------------------------------------------------------------
    def Register(self, request, context):
        if not request.node.node_id or not request.node.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node_id and address are required")
        self.registry.register(request.node)
        return pb.RegisterResponse(heartbeat_interval_s=self.cfg.heartbeat_interval_s)

    def Heartbeat(self, request, context):
        return pb.HeartbeatResponse(
            known=self.registry.heartbeat(request.node_id, request.incarnation, request.capacity)
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
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "give prompt text or prompt_token_ids, not both")
        if request.prompt:
            if self.tokenizer is None:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "this router has no tokenizer: send prompt_token_ids")
            ids = self.tokenizer.encode(request.prompt)
        else:
            ids = list(request.prompt_token_ids)
        if not ids:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt: give at least one token")
        return ids

    def _check(self, request, ids: list[int]) -> None:
        from engine.sampling_params import SamplingParams

        try:
            SamplingParams(**sampling_kwargs(request.sampling))
        except ValueError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if len(request.request_id) > MAX_REQUEST_ID_LEN:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id longer than {MAX_REQUEST_ID_LEN} characters")
        nodes = self.registry.live(pb.NODE_KIND_DECODE)
        if nodes:  # refuse what no node could ever take, rather than queueing it
            limit = max(e.info.max_model_len for e in nodes)
            if len(ids) >= limit:
                raise _Abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"prompt of {len(ids)} tokens leaves no room to generate: max_model_len is {limit}",
                )
            most = max(e.info.capacity.total_blocks for e in nodes)
            need = nodes[0].blocks_for(len(ids) + 1)
            if need > most:
                raise _Abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"prompt of {len(ids)} tokens needs {need} KV blocks; the largest decode node holds {most}",
                )
            vocab = min(e.info.vocab_size for e in nodes)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise _Abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"prompt token id(s) {bad[:5]} out of range [0, {vocab})"
                )

    def _admit(self, prompt_len: int, context, exclude: set[str]) -> NodeEntry:
        """Wait (bounded) for a decode node with room; count the request against it."""
        deadline = time.monotonic() + self.cfg.admission_timeout_s
        reg = self.registry
        with reg.cond:
            while True:
                nodes = [e for e in reg.live(pb.NODE_KIND_DECODE) if e.node_id not in exclude]
                e = self.policy.choose_decode(nodes, prompt_len)
                if e is not None:
                    e.inflight += 1
                    e.inflight_blocks += e.blocks_for(prompt_len + 1)
                    return e
                left = deadline - time.monotonic()
                if left <= 0 or not context.is_active():
                    if not nodes:
                        raise _Abort(grpc.StatusCode.UNAVAILABLE, "no live decode node")
                    raise _Abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"no decode node had room for a {prompt_len}-token prompt "
                        f"within {self.cfg.admission_timeout_s:g} s",
                    )
                reg.cond.wait(min(left, 0.25))

    def _done(self, e: NodeEntry, prompt_len: int) -> None:
        with self.registry.cond:
            e.inflight -= 1
            e.inflight_blocks -= e.blocks_for(prompt_len + 1)
            e.freed_slots += 1
            e.freed_blocks += e.blocks_for(prompt_len + 1)
            self.registry.cond.notify_all()

    def _prefill(self, d: NodeEntry, prompt_len: int) -> NodeEntry | None:
        """Seam for the prefill pool. Returns the prefill node to use, or None to prefill on d.
        Disaggregated path (next): if prompt_len >= d's local_prefill_threshold and a live
        prefill node is prefill_ready: d.Reserve -> TransferTarget, p.Prefill(prompt, target) ->
        first token (send it at once), then d.Generate(reserved=True, first_token_id); on a
        failed prefill retry once on another prefill node; on cancel p.Abort + d.Release."""
        return None

    def Generate(self, request, context):
        tr = _Trace(request.request_id or uuid.uuid4().hex)
        try:
            ids = self._prompt_ids(request)
            tr.prompt_len = len(ids)
            self._check(request, ids)
            yield from self._generate(request, ids, tr, context)
        except _Abort as a:
            tr.finish = a.code.name
            context.abort(a.code, a.msg)
        except GeneratorExit:  # the client went away between messages
            tr.finish = "cancelled"
            raise
        finally:
            self._log(tr)

    def _generate(self, request, ids: list[int], tr: _Trace, context):
        detok = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer is not None else None
        tried: set[str] = set()
        while True:
            t_admit = time.monotonic()
            d = self._admit(len(ids), context, tried)
            tr.queue_s += time.monotonic() - t_admit
            tr.decode = d.node_id
            tried.add(d.node_id)
            p = self._prefill(d, len(ids))
            tr.prefill = p.node_id if p is not None else "local"
            call = d.stub.Generate(
                pb.DecodeRequest(request_id=tr.request_id, prompt_token_ids=ids, sampling=request.sampling)
            )
            context.add_callback(call.cancel)
            first = True
            try:
                for m in call:
                    now = time.monotonic()
                    if m.token_ids:
                        tr.first = tr.first or now
                        tr.last = now
                        tr.n += len(m.token_ids)
                    out = pb.GenerateResponse(
                        request_id=tr.request_id, token_ids=m.token_ids, finish_reason=m.finish_reason
                    )
                    if detok is not None and (m.token_ids or m.finish_reason):
                        out.text = detok.push(list(m.token_ids), final=bool(m.finish_reason))
                    if first:
                        first = False
                        out.prompt_tokens = tr.prompt_len
                        out.decode_node = tr.decode
                        out.prefill_node = "" if p is None else p.node_id
                    self._timings(out.timings, m.timings, tr, now, done=bool(m.finish_reason))
                    if m.finish_reason:
                        tr.finish = m.finish_reason
                        tr.transfer_bytes, tr.transfer_s = m.timings.transfer_bytes, m.timings.transfer_s
                    yield out
                return
            except grpc.RpcError as e:
                if not context.is_active():  # the client went away; the callback cancelled upstream
                    tr.finish = "cancelled"
                    return
                code = e.code()
                others = [n for n in self.registry.live(pb.NODE_KIND_DECODE) if n.node_id not in tried]
                if code == grpc.StatusCode.UNAVAILABLE and tr.n == 0 and len(tried) < 2 and others:
                    log.warning("request %s: decode node %s unavailable, retrying elsewhere", tr.request_id, d.node_id)
                    continue
                raise _Abort(code, e.details() or code.name) from None
            finally:
                call.cancel()  # no-op when it completed; stops the node's work otherwise
                self._done(d, len(ids))

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

        self.server, port, self._health = start_server(addr, add, ["Generation", "Registry"], max_workers=256)
        self._sweeper.start()
        log.info("router serving on port %d (policy %s)", port, self.policy.name)
        return port

    def stop(self, grace: float | None = 2.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        if self.server is not None:
            self.server.stop(grace).wait(timeout=(grace or 0) + 5)
        self.registry.close()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.server.wait_for_termination(timeout)


def serve(addr: str, cfg: RouterConfig) -> tuple[Router, int]:
    router = Router(cfg)
    return router, router.start(addr)
