"""The router's one in-process `generate`, which both front ends call: tokenization, the checks no
node could pass, the request's phases, string stops, one INFO line and the metrics; errors are
`Abort(code, message)` (docs/router.md, "Module notes")."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import aclosing

import grpc
from prometheus_client import Counter, Gauge, Histogram

from proto import pb
from proto.convert import sampling_kwargs
from router.admission import BATCH, CLASS_NAMES, INTERACTIVE, Admission, Ask
from router.client_hints import HINTS, Hints
from router.client_streams import ClientStreams
from router.config import RouterConfig
from router.encode import EncodePool
from router.errors import NO_DECODE, Abort, Draining
from router.images.prepare import ImageRef, Images, Prepared, to_pb
from router.images.vision import IMAGE_PAD, VisionSpec
from router.inflight_gauges import InflightGauges
from router.migrate import MigrationMetrics, Tried
from router.model_names import served_models
from router.policy import make_policy
from router.prefill import PrefillPhase
from router.prefix import PrefixQuery
from router.registry import NodeEntry, NodeRegistry
from router.request import Chunk, RequestRun, Trace
from router.sampling_defaults import apply as apply_defaults
from router.sampling_defaults import load as load_defaults
from router.service_gauges import gauges
from router.stops import check_stops, held_back, with_stops
from router.text import TextPool, default_workers
from router.vllm_metrics import RouterVllm
from router.wait_estimate import OutputLengths, estimate
from serving.metrics import ServingMetrics
from serving.rpc import MAX_REQUEST_ID_LEN
from serving.security import OPEN, Credentials, key_id

log = logging.getLogger("pdserve.router")

# Requests in flight beyond the admission queue's limit that the router still takes (streaming);
# more are refused RESOURCE_EXHAUSTED at once.
STREAMING = 1024
# A text prompt longer than this many characters per token of the longest context a live decode
# node serves cannot fit it (tokenizers' pieces average 3-5 characters of text; a whole context
# averaging 16 is far beyond any real prompt): refused before it is tokenized.
CHARS_PER_TOKEN = 16
WAIT_POOLS = ("prefill", "decode")  # estimated_wait_seconds{pool}: what a request waits for


class GenerateService:
    def __init__(self, cfg: RouterConfig, creds: Credentials = OPEN):
        self.cfg, self.creds = cfg, creds
        self.registry = NodeRegistry(cfg.heartbeat_interval_s, cfg.dead_after_s, creds)
        for a in cfg.static_decode:
            self.registry.add_static(a, pb.NODE_KIND_DECODE)
        for a in cfg.static_prefill:
            self.registry.add_static(a, pb.NODE_KIND_PREFILL)
        self.policy = make_policy(cfg.policy, cfg.prefix_load_weight)
        self._tasks: set[asyncio.Task] = set()
        self.prefill = PrefillPhase(cfg, self.registry, self.policy, self.spawn)
        self.tokenizer = None
        self.text: TextPool | None = None  # the tokenizer's calls, long ones off the loop
        if cfg.model:
            from engine.tokenizer import Tokenizer

            if Tokenizer.exists(cfg.model):
                self.tokenizer = Tokenizer(cfg.model)
                self.text = TextPool(self.tokenizer, cfg.tokenizer_workers)
        self.active = 0  # requests in generate
        self.ids: set[str] = set()  # the request ids clients gave the requests in generate
        self.placed: set[RequestRun] = set()  # requests on a decode node now (their expected ends)
        self.tpot_s: float | None = None  # time per output token of the last requests (moving)
        self.lengths = OutputLengths()  # the last requests' output lengths (their expected ends)
        self.idle = asyncio.Event()  # set while active == 0 (the drain waits on it)
        self.idle.set()
        self.client_streams = ClientStreams()  # clients' token streams (router/client_streams.py)
        self.gauge_sources: list[Callable[[], dict[str, tuple[str, float]]]] = []  # more, as the HTTP front's
        self.draining = False
        self.metrics = ServingMetrics("pdserve_router", lambda: gauges(self), whole=True)
        reg = self.metrics.registry
        self.queue_wait = Histogram(
            "pdserve_router_queue_wait_seconds",
            "Time requests waited for admission",
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=reg,
        )
        self.refused = Counter(
            "pdserve_router_admission_refused",
            "Requests refused RESOURCE_EXHAUSTED at arrival: queue full, or the estimated wait past the budget",
            ["reason", "class"],
            registry=reg,
        )
        self.estimated_wait = Gauge(
            "pdserve_router_estimated_wait_seconds",
            "The last estimate at arrival of when a request would start, per class (inf: no decode room; "
            "0 while no request is in flight)",
            ["pool", "class"],
            registry=reg,
        )
        for c in CLASS_NAMES:
            for reason in ("queue_full", "estimate"):
                self.refused.labels(reason=reason, **{"class": c})
            for pool in WAIT_POOLS:
                self.estimated_wait.labels(pool=pool, **{"class": c})
        self.migrations = MigrationMetrics(reg)
        self.prefill.encode = EncodePool(cfg, self.registry, reg)
        vision = None
        if self.tokenizer is not None and cfg.model:
            vision = VisionSpec.load(cfg.model, self.tokenizer.token_to_id(IMAGE_PAD), cfg.hf_overrides)
        self.images = Images(cfg, vision, reg, cfg.tokenizer_workers or default_workers(), cfg.max_body_bytes)
        self.admission = Admission(cfg.max_queued_requests, self._left_queue)
        self.vllm = RouterVllm(self, reg)  # vLLM's names (router/vllm_metrics.py)
        reg.register(InflightGauges(self.registry))  # what it holds against each node
        if self.vllm.model():
            self.vllm.labelled()
        self.key_classes = cfg.key_classes
        self.sampling_defaults = load_defaults(cfg)  # for each request's unset sampling fields
        known = {key_id(d) for d in creds.api_keys}
        if unknown := sorted(set(self.key_classes) - known):
            raise ValueError(f"--api-key-priority names key id(s) {', '.join(unknown)}: no client API key has them")
        # the queue holds up to its limit once per class (Admission.decide), and the streaming beside it
        self.generate_limit = len(CLASS_NAMES) * (cfg.max_queued_requests or 4096) + STREAMING

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """Run a coroutine as a task held until it ends (releases, push watchers)."""
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def models(self) -> list[pb.ModelInfo]:
        return served_models(self.registry, self.cfg.served_model_name, self.tokenizer is not None)

    # ---- the request path -------------------------------------------------------------------
    async def generate(
        self, request: pb.GenerateRequest, images: Sequence[Prepared] | None = None
    ) -> AsyncIterator[Chunk]:
        """The chunks of one request; raises Abort (Draining while the router drains). `images`: the
        prompt's, prepared by the HTTP front (else the request's own ImageParts are)."""
        if self.draining:
            raise Draining("the router")
        tr = Trace(request.request_id or uuid.uuid4().hex)
        if self.active >= self.generate_limit:
            self._left_queue("queue_full", Ask(self.priority(request)), 0.0)
            log.info("request %s: refused RESOURCE_EXHAUSTED, %d requests in flight", tr.request_id, self.active)
            raise Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the router has {self.generate_limit} requests in flight, its limit: try again later",
            )
        if rid := request.request_id:  # a second stream of an id would take the first's tokens
            if rid in self.ids:
                raise Abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already in flight at this router")
            self.ids.add(rid)
        self.active += 1
        self.idle.clear()
        try:
            apply_defaults(request.sampling, self.sampling_defaults)
            ids, inputs = await self._prompt_ids(request, images)
            tr.prompt_len, tr.images = len(ids), len(inputs)
            self.check_ask(request)
            # the class it is admitted in travels to the nodes, which schedule by it
            request.sampling.priority = (
                pb.PRIORITY_BATCH if self.priority(request) == BATCH else pb.PRIORITY_INTERACTIVE
            )
            self._check(request, ids)
            self.images.accepted(inputs)
            run = RequestRun(self, request, ids, tr, to_pb(inputs))
            sp = request.sampling
            min_tokens = max(0, sp.min_tokens - len(run.sent))  # a resumed stream's tokens count
            held = held_back(run.resumed_text, list(sp.stop)) if not min_tokens else ""
            stream = with_stops(
                run.chunks(),
                list(sp.stop),
                min_tokens,
                tr.stopped,
                sp.include_stop_str_in_output,
                held,
            )
            async with aclosing(stream) as chunks:
                async for c in chunks:
                    yield c
        except Abort as a:
            tr.finish = a.code.name
            raise
        except (GeneratorExit, asyncio.CancelledError):  # the client went away
            tr.finish = "cancelled"
            raise
        finally:
            tr.log()
            e2e, done = (tr.last - tr.received, tr.prompt_len) if tr.last is not None else (None, 0)  # computed
            self.metrics.request_done(tr.outcome(), tr.ttft(), tr.tpot(), tr.n, e2e, done)
            self.vllm.ended(tr)
            if tr.decode != "-":  # it was placed: it held its decode room for its output
                self.lengths.ended(tr.n)
            if (tp := tr.tpot()) is not None:
                self.tpot_s = tp if self.tpot_s is None else self.tpot_s + 0.25 * (tp - self.tpot_s)
            if tr.transfer_bytes:
                self.metrics.transfer_done(tr.transfer_bytes, tr.transfer_s)
            self.active -= 1
            self.ids.discard(rid)
            if not self.active:
                self.idle.set()
                # nothing in flight: the last arrival's estimate no longer holds (a dashboard read a
                # burst's last figure, +Inf at worst, on an idle router until the next request)
                for c in CLASS_NAMES:
                    for pool in WAIT_POOLS:
                        self.estimated_wait.labels(pool=pool, **{"class": c}).set(0.0)

    def prompt_chars_limit(self) -> tuple[int, str]:
        """The most characters a text prompt may have, and what sets it (checked before tokenizing)."""
        limit, why = self.cfg.max_prompt_chars, "--max-prompt-chars"
        nodes = self.registry.live(pb.NODE_KIND_DECODE)
        if nodes:
            ctx = max(e.info.max_model_len for e in nodes)
            if CHARS_PER_TOKEN * ctx < limit:
                limit, why = CHARS_PER_TOKEN * ctx, f"{CHARS_PER_TOKEN} per token of max_model_len {ctx}"
        return limit, why

    def check_prompt_chars(self, chars: int, what: str = "prompt") -> None:
        """Abort INVALID_ARGUMENT when a text of `chars` characters is too long to tokenize."""
        limit, why = self.prompt_chars_limit()
        if chars > limit:
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{what} of {chars:,} characters is longer than the limit of {limit:,} characters ({why})",
            )

    def expansion_limit(self) -> int:
        """The most sequences one request may expand into (prompts x n): what an idle router takes
        at once, its admission queue plus the live decode nodes' state slots (0: no limit)."""
        q = self.cfg.max_queued_requests
        if not q:
            return 0
        return q + sum(e.info.capacity.total_slots for e in self.registry.routable(pb.NODE_KIND_DECODE))

    async def encode(self, text: str, what: str = "prompt") -> list[int]:
        """Token ids of a text prompt: its length checked first, long ones tokenized off the loop."""
        if self.text is None:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "this router has no tokenizer: send prompt_token_ids")
        self.check_prompt_chars(len(text), what)
        return await self.text.encode(text)

    async def prompt_ids(self, request, images: Sequence[Prepared] | None) -> list[int]:
        """The prompt's token ids as the nodes get them (images expanded)."""
        return list((await self._prompt_ids(request, images))[0])

    async def _prompt_ids(self, request, images: Sequence[Prepared] | None):
        """The prompt's token ids, each image's placeholder expanded, and its images (ImageInputs)."""
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if request.prompt and request.prompt_token_ids:
            raise Abort(bad, "give prompt text or prompt_token_ids, not both")
        if (images or request.images) and not request.prompt:
            raise Abort(bad, "images need a text prompt holding one <|vision_start|><|image_pad|><|vision_end|> each")
        if request.prompt:
            ids = await self.encode(request.prompt)
        else:
            ids = list(request.prompt_token_ids)
        if not ids:
            raise Abort(bad, "empty prompt: give at least one token")
        if images is None:
            refs = [_ref(i, p) for i, p in enumerate(request.images)]
            images = await self.images.prepare(refs, self.images.request_bounds(request))
        return self.images.expand(ids, images)

    def _check(self, request, ids: list[int]) -> None:
        from engine.sampling_params import SamplingParams

        bad = grpc.StatusCode.INVALID_ARGUMENT
        try:
            SamplingParams(**sampling_kwargs(request.sampling))
            check_stops(list(request.sampling.stop))
        except ValueError as e:
            raise Abort(bad, str(e)) from None
        if request.sampling.stop and self.tokenizer is None:
            raise Abort(bad, "stop strings need a tokenizer on the router: use stop_token_ids")
        if len(request.request_id) > MAX_REQUEST_ID_LEN:
            raise Abort(bad, f"request_id longer than {MAX_REQUEST_ID_LEN} characters")
        nodes = self.registry.live(pb.NODE_KIND_DECODE)
        if not nodes:
            return
        # refuse what no node could ever take, rather than queueing it
        limit = max(e.info.max_model_len for e in nodes)
        one = request.sampling.HasField("max_tokens") and request.sampling.max_tokens == 1  # scoring a full prompt
        if len(ids) > limit or (len(ids) == limit and not one):
            raise Abort(bad, f"prompt of {len(ids)} tokens leaves no room to generate: max_model_len is {limit}")
        most = max(e.info.capacity.total_blocks for e in nodes)
        need = nodes[0].blocks_for(len(ids) + 1)
        if need > most:
            raise Abort(
                bad, f"prompt of {len(ids)} tokens needs {need} KV blocks; the largest decode node holds {most}"
            )
        vocab = min(e.info.vocab_size for e in nodes)
        out = [t for t in ids if not 0 <= t < vocab]
        if out:
            raise Abort(bad, f"prompt token id(s) {out[:5]} out of range [0, {vocab})")
        out = [t for t in request.resume_token_ids if not 0 <= t < vocab]
        if out:
            raise Abort(bad, f"resume token id(s) {out[:5]} out of range [0, {vocab})")
        out = [t for t in request.sampling.logit_bias if t >= vocab]
        if out:
            raise Abort(bad, f"logit_bias token id(s) {sorted(out)[:5]} out of range [0, {vocab})")

    # ---- admission and the decode nodes' counters -------------------------------------------
    def _left_queue(self, outcome: str, ask: Ask, wait_s: float) -> None:
        if outcome in ("queue_full", "estimate"):
            self.refused.labels(reason=outcome, **{"class": ask.class_name}).inc()
        else:
            self.queue_wait.observe(wait_s)

    def priority(self, request: pb.GenerateRequest | None) -> int:
        """The request's class: what it asks (the HTTP header, else its field; interactive by
        default), never above its API key's class (--api-key-priority)."""
        h = HINTS.get() or Hints()
        asked = h.priority
        if asked is None:
            asked = BATCH if request is not None and request.priority == pb.PRIORITY_BATCH else INTERACTIVE
        return max(asked, self.key_classes.get(h.tenant, INTERACTIVE))

    def ask(self, request: pb.GenerateRequest | None, tokens: int, resumed: bool, alone: bool = False) -> Ask:
        """What the request asks of admission: its class (`priority`), its budget from its
        field, the HTTP header or the router's default, and its API key."""
        h = HINTS.get() or Hints()
        budget = h.budget_s
        if request is not None and budget is None and request.HasField("admission_timeout_s"):
            budget = request.admission_timeout_s
        if budget is None:
            budget = self.cfg.admission_timeout_s
        return Ask(self.priority(request), h.tenant, budget, tokens, resumed, alone)

    def check_ask(self, request: pb.GenerateRequest) -> None:
        t = request.admission_timeout_s
        if request.HasField("admission_timeout_s") and not (t >= 0 and t < float("inf")):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"admission_timeout_s must be >= 0 (0: no limit), got {t}")
        if request.priority not in (pb.PRIORITY_UNSPECIFIED, pb.PRIORITY_INTERACTIVE, pb.PRIORITY_BATCH):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown priority {request.priority}")

    async def admit(
        self,
        ids: list[int],
        exclude: Tried,
        local: bool,
        request: pb.GenerateRequest | None = None,
        resumed: bool = False,
        trace: Trace | None = None,
        images: Sequence[pb.ImageInput] = (),
        alone: bool = False,
    ) -> tuple[NodeEntry | None, tuple[NodeEntry, int] | None, int]:
        """Decide at arrival, then wait in turn until the prompt `ids` is placed: (decode node,
        the prefill node and the prompt tokens counted against it, or None to prefill on the
        decode node; the prompt tokens the decode node computes itself), both nodes counted against until `done` (and the prefill phase's own
        give-back; the decode node's own prompt tokens: `local_prefill_done`). local: prefill on
        the decode node (logprobs: P returns none). resumed: admitted before (a retry, a failover): never refused for lack of
        budget. alone: the request ends at its first token; a prompt for the prefill pool then
        takes no decode node (None): neither its room nor its wait. Refused (RESOURCE_EXHAUSTED,
        retry_after_s) at arrival only."""
        prompt_len = len(ids)
        salt = request.sampling.cache_salt if request is not None else ""
        q = PrefixQuery(ids, images, salt) if self.policy.uses_prefix else None
        dec = [e for e in self.registry.routable(pb.NODE_KIND_DECODE) if e not in exclude]
        pooled = not local and bool(dec) and self.prefill.use_pool(dec[0], prompt_len)
        alone = alone and pooled
        cached = 0  # what it brings to the prefill pool: its prompt less the most a prefill node has cached
        if pooled and q is not None:
            with self.registry.lock:
                cached = max(
                    (p.cache.usable(q, compute=True) for p in self.prefill.ready(dec[0], set(), prompt_len)), default=0
                )
        ask = self.ask(request, prompt_len - cached if pooled else 0, resumed, alone)
        ahead_tokens, ahead, ahead_squares = self.admission.ahead(ask.priority)
        ends = [r.expected_end_s(self.tpot_s, self.lengths) for r in self.placed]
        est, what = estimate(
            self.registry,
            self.prefill.meter,
            prompt_len,
            ask.tokens,
            ahead_tokens,
            ahead,
            ahead_squares,
            ends,
            ask.priority == BATCH,
            decode=not alone,
        )
        pool = "prefill" if ask.tokens else "decode"
        self.estimated_wait.labels(pool=pool, **{"class": ask.class_name}).set(est)
        if trace is not None and trace.estimate_s is None:  # the one made at arrival
            trace.estimate_s = est
        self.admission.decide(ask, est, what)

        def unavailable() -> Abort | None:
            if not [e for e in self.registry.routable(pb.NODE_KIND_DECODE) if e not in exclude]:
                return Abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{NO_DECODE} (none took new requests within this request's {ask.budget_s:g} s admission budget)",
                )
            return None

        batch = ask.priority == BATCH
        if alone:
            return await self.admission.wait(ask, lambda: self._place_alone(prompt_len, exclude, q, batch), unavailable)
        return await self.admission.wait(ask, lambda: self._place(prompt_len, exclude, local, q, batch), unavailable)

    def _place_alone(
        self, prompt_len: int, exclude: Tried, q: PrefixQuery | None, batch: bool
    ) -> tuple[NodeEntry | None, tuple[NodeEntry, int] | None, int] | None:
        """A prefill node within its window for a request that ends at its first token, and no
        decode node; the usual placement when no prefill node takes prompts any more."""
        if not self.prefill.ready(None, set(), prompt_len):
            return self._place(prompt_len, exclude, False, q, batch)
        chosen = self.prefill.choose(None, prompt_len, set(), window=True, q=q, batch=batch)
        if chosen is None:
            self.admission.blocked(on_decode=False)
            return None  # every prefill node has its window of work: wait
        if q is not None:
            chosen[0].cache.remember(q, compute=True, ttl_s=self.cfg.prefix_memory_s)
        return None, chosen, 0

    def _place(
        self, prompt_len: int, exclude: Tried, local: bool, q: PrefixQuery | None, batch: bool
    ) -> tuple[NodeEntry, tuple[NodeEntry, int] | None, int] | None:
        """A decode node with room and, when the prompt goes through the prefill pool, a prefill
        node within its window; None: not now. With a PrefixQuery (cache-aware), the pool decision
        counts only what the decode node would still compute, and both nodes remember the prompt."""

        def pooled(e: NodeEntry, uncached: int) -> bool:
            return not local and self.prefill.use_pool(e, uncached, prompt_len - uncached)

        with self.registry.lock:
            nodes = [e for e in self.registry.routable(pb.NODE_KIND_DECODE) if e not in exclude]
            d = self.policy.choose_decode(nodes, prompt_len, q, pooled)
            if d is None:
                self.admission.blocked(on_decode=True)
                return None
            chosen = None
            uncached = prompt_len - (d.cache.usable(q, compute=True) if q is not None else 0)
            if pooled(d, uncached):
                chosen = self.prefill.choose(d, prompt_len, set(), window=True, q=q, batch=batch)
                if chosen is None:
                    self.admission.blocked(on_decode=False)
                    return None  # every prefill node has its window of work: wait, reserving nothing
            p = chosen[0] if chosen is not None else None
            if q is not None:
                ttl = self.cfg.prefix_memory_s
                d.cache.remember(q, compute=p is None, ttl_s=ttl)
                if p is not None:
                    p.cache.remember(q, compute=True, ttl_s=ttl)
            d.inflight += 1
            d.inflight_blocks += d.blocks_for(prompt_len + 1)
            # computed on d: its queue until the first token (its reports lag by a heartbeat)
            own = 0 if p is not None else uncached
            d.prefill_sent(own)
            return d, chosen, own

    def remember_end(self, d: NodeEntry, seq: list[int], request: pb.GenerateRequest, images) -> None:
        """Decode node d ended a request itself (`seq`: its prompt and output): it keeps the
        final state and the reply's pages (NodeCache.remember_end)."""
        if self.policy.uses_prefix:
            q = PrefixQuery(seq, images, request.sampling.cache_salt)
            with self.registry.lock:
                d.cache.remember_end(q, self.cfg.prefix_memory_s)

    def local_prefill_done(self, d: NodeEntry, tokens: int) -> None:
        """Give back what `admit` counted against decode node d's queue for a prompt it computes
        itself (NodeEntry.prefill_back)."""
        with self.registry.lock:
            d.prefill_back(tokens)
        self.registry.on_change()

    def done(self, d: NodeEntry, prompt_len: int, seq: int = 0) -> None:
        """A request placed on d ended; `seq`: the node's count of ends with it (node_ended)."""
        with self.registry.lock:
            d.inflight -= 1
            d.inflight_blocks -= d.blocks_for(prompt_len + 1)
            d.credit(1, d.blocks_for(prompt_len + 1), seq)
        self.registry.on_change()

    async def close(self) -> None:
        if self.text is not None:
            self.text.close()
        self.images.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.registry.close()


def _ref(i: int, part: pb.ImagePart) -> ImageRef:
    where = f"images[{i}]"
    if not part.data and not part.url:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where} is empty: give the image's bytes (data) or its url")
    if part.data and part.url:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: give the image's data or its url, not both")
    return ImageRef(where, url=part.url, data=part.data)
