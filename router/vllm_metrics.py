"""The router's vLLM series (docs/api.md, "vLLM's metric names"): the cluster as one vLLM server
would show it. Gauges read at scrape time: the admission queue (`vllm:num_requests_waiting`), the
requests past it (`vllm:num_requests_running`), the decode pool's KV pages (last heartbeats). The
per-request series, which only the router can keep (it alone sees a request from arrival to its
last token): tokens, outcomes by `finished_reason`, TTFT, inter-token latency, end-to-end and
queue time, per-request sizes. The nodes' own series: serving/vllm_metrics.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric

from proto import pb
from serving.vllm_metrics import LABEL, gauge, kv_usage, model_id

if TYPE_CHECKING:
    from router.request import Trace
    from router.service import GenerateService

REASONS = ("stop", "length", "abort", "error")
# refused before it was a request (a bad field, an id in use): vLLM answers those 400 uncounted
NOT_A_REQUEST = frozenset({"INVALID_ARGUMENT", "ALREADY_EXISTS", "NOT_FOUND", "UNAUTHENTICATED", "PERMISSION_DENIED"})
_ABORTED = frozenset({"cancelled", "abort", "CANCELLED", "-"})
_LAT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)


def finished_reason(finish: str) -> str | None:
    """vLLM's finished_reason for a Trace's finish; None: not counted (refused at the door)."""
    if finish in ("stop", "length"):
        return finish
    if finish in _ABORTED:
        return "abort"
    return None if finish in NOT_A_REQUEST else "error"


class RouterVllm:
    def __init__(self, svc: GenerateService, registry: CollectorRegistry) -> None:
        self.svc = svc
        self._model = ""
        r, lab = registry, [LABEL]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests prefilled", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", lab, registry=r)
        self.success = Counter(
            "vllm:request_success", "Requests finished, by finished_reason", [LABEL, "finished_reason"], registry=r
        )

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, lab, buckets=buckets, registry=r)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Request received to its first token", _LAT)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between a request's successive outputs", _ITL)
        self.tpot = hist(
            "vllm:time_per_output_token_seconds",
            "The same as vllm:inter_token_latency_seconds (vLLM's older name)",
            _ITL,
        )
        self.req_tpot = hist(
            "vllm:request_time_per_output_token_seconds", "A request's mean time per output token after the first", _ITL
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request received to its end", _E2E)
        self.queue = hist("vllm:request_queue_time_seconds", "Time a request waited in the admission queue", _E2E)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per finished request", _TOKENS)
        self.req_gen = hist("vllm:request_generation_tokens", "Tokens generated per finished request", _TOKENS)
        registry.register(_Gauges(self))

    def model(self) -> str:
        """The model_name label: the first --served-model-name, else the router's checkpoint's
        default name, else that of the live nodes' model (the id /v1/models gives)."""
        if not self._model:
            cfg = self.svc.cfg
            if cfg.served_model_name:
                self._model = cfg.served_model_name[0]
            elif cfg.model:
                self._model = model_id(cfg.model)
            else:
                nodes = self.svc.registry.live(pb.NODE_KIND_DECODE) or self.svc.registry.live(pb.NODE_KIND_PREFILL)
                self._model = model_id(nodes[0].info.model) if nodes and nodes[0].info.model else ""
        return self._model

    def labelled(self) -> None:
        """Create every series with its labels (zero until the first request), so rate() sees them."""
        m = self.model()
        for c in (self.prompt_tokens, self.generation_tokens):
            c.labels(m)
        for reason in REASONS:
            self.success.labels(m, reason)

    def first_token(self, tr: Trace, now: float) -> None:
        """The request's first token came back: its prefill is done."""
        m = self.model()
        self.ttft.labels(m).observe(now - tr.received)
        self.prompt_tokens.labels(m).inc(tr.prompt_len)

    def next_output(self, gap_s: float) -> None:
        """An output after the first came, gap_s after the one before it."""
        m = self.model()
        self.itl.labels(m).observe(gap_s)
        self.tpot.labels(m).observe(gap_s)

    def ended(self, tr: Trace) -> None:
        """The request ended; `tr.n`: the tokens its client got."""
        m = self.model()
        if tr.n:
            self.generation_tokens.labels(m).inc(tr.n)
        reason = finished_reason(tr.finish)
        if reason is None:
            return
        self.success.labels(m, reason).inc()
        self.e2e.labels(m).observe(time.monotonic() - tr.received)
        self.queue.labels(m).observe(tr.queue_s)
        self.req_prompt.labels(m).observe(tr.prompt_len)
        self.req_gen.labels(m).observe(tr.n)
        if (tpot := tr.tpot()) is not None:
            self.req_tpot.labels(m).observe(tpot)


class _Gauges:
    def __init__(self, v: RouterVllm) -> None:
        self.v = v

    def collect(self) -> Iterator[Metric]:
        svc, m = self.v.svc, self.v.model()
        waiting = svc.admission.depth()
        caps = [e.info.capacity for e in svc.registry.live(pb.NODE_KIND_DECODE)]
        total, free = sum(c.total_blocks for c in caps), sum(c.free_blocks for c in caps)
        yield gauge("vllm:num_requests_waiting", "Requests waiting in the router's admission queue", m, waiting)
        yield gauge(
            "vllm:num_requests_running",
            "Requests past admission: prefilling, transferring or decoding",
            m,
            max(0, svc.active - waiting),
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of the live decode nodes' KV cache pages in use, 0-1 (their last heartbeats)",
            m,
            kv_usage(total, free),
        )
