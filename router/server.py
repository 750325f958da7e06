"""The router: `serve(addr, cfg) -> (router, port)`.

Serves `Generation` (clients) and `Registry` (nodes), plus health and reflection. One request:

    validate (prompt, sampling) -> tokenize text -> admission: wait (bounded) until the policy
    finds a decode node D with room -> prefill phase (_prefill) -> stream D's tokens back, with
    text deltas and the router's timings -> one INFO line (with transfer bytes and ms)

Prefill phase (DESIGN.md section 1), when the prompt is at least D's local-prefill threshold
and a prefill node is ready: D.Reserve -> TransferTarget; choose a prefill node P (policy);
make sure P and D have handshaken (the router brokers it once per node pair and incarnation:
P's rank blobs to D, D's to P); P.Prefill(prompt, target) streams the first token as soon as it
is sampled, which goes to the client at once, while P's ranks push the state; D.Generate(
reserved=True, first_token_id) waits on D for every rank's state and streams the rest. A thread
reads P's stream to its end (`_Push`): the transfer figures, or a failed push, which releases
D's reservation (D's call then ends ABORTED and the client gets the push's error). A failed prefill releases
the reservation and is tried once more on another prefill node (a new reservation); a prefill
node that answered UNAVAILABLE is marked dead and D drops its transfer agents; with no other
prefill node left, D prefills the prompt itself. Otherwise D prefills locally (colocated).

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
    reservation_lease_s: float = 30.0  # lease asked of a decode node's Reserve
    prefill_timeout_s: float = 120.0  # one Prefill call (queue + compute + push) at most
    # Conditional disaggregation by load: when every ready prefill node has at least this many
    # prompt tokens queued (its last report plus what the router sent since), the decode node
    # prefills the prompt itself instead of queueing behind them. 0: no limit.
    max_prefill_queue_tokens: int = 0
    metrics_port: int | None = None  # Prometheus /metrics on this port (0 picks one; None: off)
    http_port: int | None = None  # OpenAI-compatible HTTP on this port (0 picks one; None: off)
    host: str = "127.0.0.1"  # where the metrics and HTTP ports bind

    def __post_init__(self):
        if self.dead_after_s <= self.heartbeat_interval_s:
            raise ValueError("dead_after_s must exceed heartbeat_interval_s")
        if self.admission_timeout_s < 0:
            raise ValueError("admission_timeout_s must be >= 0")
        if self.max_prefill_queue_tokens < 0:
            raise ValueError("max_prefill_queue_tokens must be >= 0 (0: no limit)")
        make_policy(self.policy)


class _DecodeFailed(Exception):
    """The decode node refused or could not take a reservation (retry on another decode node)."""

    def __init__(self, err: grpc.RpcError):
        super().__init__(str(err))
        self.err = err


class _Push:
    """A prefill node's push into D's reservation, after it streamed the first token: a thread
    reads the rest of the Prefill stream (the `pushed` message with the transfer figures, or the
    status of a failed push) while D already waits for the state and then decodes."""

    def __init__(self, p: NodeEntry, d: NodeEntry, rid: str, first: pb.PrefillResponse, call, on_fail):
        self.p, self.d, self.rid, self.first, self.call = p, d, rid, first, call
        self.pushed: pb.Timings | None = None
        self.error: grpc.RpcError | None = None
        self.done = threading.Event()
        self._on_fail = on_fail
        if first.finish_reason:  # the first token ended the request: nothing is pushed
            self.done.set()
        else:
            threading.Thread(target=self._watch, name=f"push-{rid}", daemon=True).start()

    def _watch(self) -> None:
        try:
            for m in self.call:
                if m.pushed:
                    self.pushed = m.timings
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = e
                self._on_fail(self, e)
        finally:
            self.done.set()

    def timings(self, wait_s: float = 0.0) -> pb.Timings:
        """prefill_s from the first message; transfer_s and bytes once pushed (waits up to wait_s)."""
        self.done.wait(wait_s)
        t = pb.Timings(prefill_s=self.first.timings.prefill_s)
        if self.pushed is not None:
            t.transfer_s, t.transfer_bytes = self.pushed.transfer_s, self.pushed.transfer_bytes
        return t


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
        self._pairs: set[tuple] = set()  # (prefill id, incarnation, decode id, incarnation) handshaken
        self._pair_lock = threading.Lock()
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="sweeper", daemon=True)
        self._queued = 0  # requests waiting in admission (under registry.cond)
        self._active = 0  # requests in Generate (under registry.cond)
        self.metrics = ServingMetrics("pdserve_router", self._gauges)
        self.metrics_port: int | None = None
        self.http = None  # router.http.OpenAIServer when cfg.http_port is set
        self.http_port: int | None = None
        self.draining = False

    def _gauges(self) -> dict[str, tuple[str, float]]:
        dec = self.registry.live(pb.NODE_KIND_DECODE)
        caps = [e.info.capacity for e in dec]
        return {
            "queue_depth": ("Requests waiting for admission", self._queued),
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
            self._queued += 1
            try:
                return self._admit_locked(prompt_len, context, exclude, deadline)
            finally:
                self._queued -= 1

    def _admit_locked(self, prompt_len: int, context, exclude: set[str], deadline: float) -> NodeEntry:
        reg = self.registry
        while True:
            nodes = [e for e in reg.routable(pb.NODE_KIND_DECODE) if e.node_id not in exclude]
            e = self.policy.choose_decode(nodes, prompt_len)
            if e is not None:
                e.inflight += 1
                e.inflight_blocks += e.blocks_for(prompt_len + 1)
                return e
            left = deadline - time.monotonic()
            if left <= 0 or not context.is_active():
                if not nodes:
                    raise _Abort(grpc.StatusCode.UNAVAILABLE, "no live decode node takes new requests")
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

    # ---- the prefill pool ----------------------------------------------------------------------
    def _ready_prefill(self, d: NodeEntry, exclude: set[str]) -> list[NodeEntry]:
        dg = d.info.schema_digest
        return [
            p
            for p in self.registry.routable(pb.NODE_KIND_PREFILL)
            if p.info.prefill_ready and p.node_id not in exclude and (not dg or p.info.schema_digest in ("", dg))
        ]

    def _use_pool(self, d: NodeEntry, prompt_len: int) -> bool:
        """Conditional disaggregation: short prompts (under D's threshold) prefill on D, as do all
        prompts when no prefill node is ready or every one is loaded past
        `max_prefill_queue_tokens`."""
        if prompt_len < d.info.local_prefill_threshold or not d.info.schema_digest:
            return False
        ready = self._ready_prefill(d, set())
        limit = self.cfg.max_prefill_queue_tokens
        if limit and ready:
            with self.registry.cond:
                queued = [p.info.capacity.queued_prefill_tokens + p.inflight_prefill_tokens for p in ready]
            if min(queued) >= limit:
                return False
        return bool(ready)

    def _handshake(self, p: NodeEntry, d: NodeEntry) -> None:
        """Broker the transfer handshake of (P, D) once per pair of incarnations."""
        key = (p.node_id, p.info.incarnation, d.node_id, d.info.incarnation)
        if key in self._pairs:
            return
        with self._pair_lock:
            if key in self._pairs:
                return
            pr = p.stub.Handshake(pb.HandshakeRequest(node_id="router"), timeout=60)
            dr = d.stub.Handshake(
                pb.HandshakeRequest(node_id=p.node_id, incarnation=p.info.incarnation, schema=pr.schema), timeout=60
            )
            p.stub.Handshake(
                pb.HandshakeRequest(node_id=d.node_id, incarnation=d.info.incarnation, schema=dr.schema), timeout=60
            )
            self._pairs.add(key)
            log.info("transfer handshake %s <-> %s done", p.node_id, d.node_id)

    def _forget_prefill(self, p: NodeEntry) -> None:
        with self._pair_lock:
            self._pairs = {k for k in self._pairs if k[0] != p.node_id}

    def _forget_pair(self, p: NodeEntry, d: NodeEntry) -> None:
        """Handshake (P, D) again next time: a failed prefill may mean D dropped P's agents (another
        router declared P dead); the handshake is idempotent and cheap."""
        with self._pair_lock:
            self._pairs = {k for k in self._pairs if (k[0], k[2]) != (p.node_id, d.node_id)}

    def _release(self, d: NodeEntry, rid: str, reason: str, dead_prefill: str = "") -> None:
        try:
            d.stub.Release(
                pb.ReleaseRequest(request_id=rid, reason=reason, dead_prefill_node=dead_prefill), timeout=30
            )
        except grpc.RpcError as e:
            log.warning("release of %s on %s failed: %s", rid, d.node_id, e.code().name)

    def _reserve(self, d: NodeEntry, rid: str, ids: list[int], request, context) -> pb.TransferTarget:
        """D.Reserve, retried while D is momentarily full (bounded by the admission wait)."""
        deadline = time.monotonic() + self.cfg.admission_timeout_s
        while True:
            try:
                return d.stub.Reserve(
                    pb.ReserveRequest(
                        request_id=rid, prompt_token_ids=ids, sampling=request.sampling,
                        lease_s=self.cfg.reservation_lease_s,
                    ),
                    timeout=30,
                ).target  # fmt: skip
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                if not context.is_active():
                    raise _Abort(grpc.StatusCode.CANCELLED, "the client went away") from None
                time.sleep(0.02)

    def _prefill(self, d: NodeEntry, request, ids: list[int], tr: _Trace, context) -> _Push | None:
        """Reserve on D, prefill on a prefill node (one retry elsewhere) until it streams the first
        token. Returns the _Push (first token, the push still running), or None to prefill on D."""
        n = len(ids)
        tried: set[str] = set()
        attempt = 0  # reservations made (each under its own id)
        failures = 0  # prefill calls that failed (a drain refusal is not one)
        while True:
            with self.registry.cond:
                p = self.policy.choose_prefill(self._ready_prefill(d, tried), n)
                if p is not None:
                    p.inflight_prefill_tokens += n
            if p is None:
                return None
            tried.add(p.node_id)
            rid = tr.request_id if attempt == 0 else f"{tr.request_id}~{attempt}"
            reserved = False
            try:
                try:
                    target = self._reserve(d, rid, ids, request, context)
                except grpc.RpcError as e:
                    raise _DecodeFailed(e) from None
                reserved = True
                self._handshake(p, d)
                call = p.stub.Prefill(
                    pb.PrefillRequest(request_id=rid, prompt_token_ids=ids, sampling=request.sampling, target=target),
                    timeout=self.cfg.prefill_timeout_s,
                )
                context.add_callback(call.cancel)
                first = next(call, None)
                if first is None:  # a stream with no message: a broken node
                    call.cancel()
                    raise _Abort(grpc.StatusCode.INTERNAL, f"prefill node {p.node_id} answered nothing")
                return _Push(p, d, rid, first, call, self._push_failed)
            except grpc.RpcError as e:
                if not context.is_active():
                    if reserved:
                        self._release(d, rid, "the client went away")
                    raise _Abort(grpc.StatusCode.CANCELLED, "the client went away") from None
                code = e.code()
                attempt += 1
                if is_draining(e):  # alive, finishing its own work: place this prompt elsewhere
                    self.registry.mark_draining(p)
                    if reserved:
                        self._release(d, rid, f"{p.node_id} is draining")
                    if self._ready_prefill(d, tried):
                        continue
                    return None  # no other prefill node: D prefills the prompt itself
                dead = code == grpc.StatusCode.UNAVAILABLE
                if dead:
                    with self.registry.cond:
                        p.alive = False  # back with its next heartbeat, if it is alive after all
                    self._forget_prefill(p)
                self._forget_pair(p, d)
                if reserved:
                    self._release(d, rid, f"prefill on {p.node_id} failed: {code.name}", p.node_id if dead else "")
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise _Abort(code, e.details() or code.name) from None
                failures += 1
                others = self._ready_prefill(d, tried)
                log.warning(
                    "request %s: prefill on %s failed (%s: %s)%s", tr.request_id, p.node_id, code.name, e.details(),
                    "; retrying on another prefill node" if failures < 2 and others else "",
                )  # fmt: skip
                if failures < 2 and others:
                    continue
                if dead and not others:
                    return None  # no prefill node left: D prefills the prompt itself
                raise _Abort(code, f"prefill failed on {p.node_id}: {e.details() or code.name}") from None
            finally:
                with self.registry.cond:
                    p.inflight_prefill_tokens -= n

    def _push_failed(self, push: _Push, e: grpc.RpcError) -> None:
        """The push failed after the first token went out (watcher thread): free D's reservation,
        which ends D's Generate(reserved) with ABORTED; a prefill node that became unreachable
        is marked dead and D drops its transfer agents."""
        dead = e.code() == grpc.StatusCode.UNAVAILABLE and not is_draining(e)
        log.warning("request %s: push from %s failed (%s: %s)", push.rid, push.p.node_id, e.code().name, e.details())
        if dead:
            with self.registry.cond:
                push.p.alive = False
            self._forget_prefill(push.p)
        self._release(push.d, push.rid, f"push from {push.p.node_id} failed: {e.code().name}",
                      push.p.node_id if dead else "")  # fmt: skip

    def Generate(self, request, context):
        if self.draining:
            refuse_draining(context, "the router")
        tr = _Trace(request.request_id or uuid.uuid4().hex)
        with self.registry.cond:
            self._active += 1
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
            d = self._admit(len(ids), context, tried)
            tr.queue_s += time.monotonic() - t_admit
            tr.decode = d.node_id
            tried.add(d.node_id)
            pre = None
            call = None
            settled = False  # the reservation (if any) is activated, released or never made
            try:
                if self._use_pool(d, len(ids)):
                    pre = self._prefill(d, request, ids, tr, context)
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
                        self._release(d, pre.rid, "finished at the first token")
                        return
                    # D waits for every rank's state, then decodes
                    call = d.stub.Generate(
                        pb.DecodeRequest(
                            request_id=pre.rid, prompt_token_ids=ids, sampling=request.sampling, reserved=True,
                            first_token_id=resp.first_token_id,
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
            except _DecodeFailed as df:
                e = df.err
                code = e.code()
                if self._placed_elsewhere(e, d, tr):
                    continue
                others = [n for n in self.registry.routable(pb.NODE_KIND_DECODE) if n.node_id not in tried]
                if code == grpc.StatusCode.UNAVAILABLE and tr.n == 0 and len(tried) < 2 and others:
                    log.warning("request %s: decode node %s unavailable, retrying elsewhere", tr.request_id, d.node_id)
                    continue
                raise _Abort(code, e.details() or code.name) from None
            except grpc.RpcError as e:
                if not context.is_active():  # the client went away; the callback cancelled upstream
                    tr.finish = "cancelled"
                    return
                code = e.code()
                if self._placed_elsewhere(e, d, tr):
                    continue
                if pre is not None and code == grpc.StatusCode.ABORTED and pre.done.wait(5.0) and pre.error is not None:
                    pe = pre.error  # D gave up because the push failed: report why
                    raise _Abort(pe.code(), f"pushing the state from {pre.p.node_id} failed: "
                                 f"{pe.details() or pe.code().name}") from None  # fmt: skip
                others = [n for n in self.registry.routable(pb.NODE_KIND_DECODE) if n.node_id not in tried]
                if code == grpc.StatusCode.UNAVAILABLE and tr.n == 0 and len(tried) < 2 and others:
                    log.warning("request %s: decode node %s unavailable, retrying elsewhere", tr.request_id, d.node_id)
                    continue
                raise _Abort(code, e.details() or code.name) from None
            finally:
                if call is not None:
                    call.cancel()  # no-op when it completed; stops the node's work otherwise
                if pre is not None:
                    if not settled:  # ended between the prefill and decode: free it now
                        self._release(d, pre.rid, "the request ended before decode began")
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
        out = pb.GenerateResponse(request_id=tr.request_id, token_ids=m.token_ids, finish_reason=m.finish_reason)
        if detok is not None and (m.token_ids or m.finish_reason):
            out.text = detok.push(list(m.token_ids), final=bool(m.finish_reason))
        if first:
            out.prompt_tokens = tr.prompt_len
            out.decode_node = tr.decode
            out.prefill_node = "" if pre is None else pre.p.node_id
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

        self.server, port, self._health = start_server(addr, add, ["Generation", "Registry"], max_workers=256)
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


def serve(addr: str, cfg: RouterConfig) -> tuple[Router, int]:
    router = Router(cfg)
    return router, router.start(addr)
