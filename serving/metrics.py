"""Prometheus metrics shared by the router and the nodes: one `CollectorRegistry` per server (so
several servers can share a process), served on its own HTTP port at `/metrics`.

`ServingMetrics` holds the counters and histograms every server keeps (requests by outcome, TTFT,
TPOT, generated tokens, transfer bytes / seconds / failures); gauges that mirror live state (queue
depth, KV pages and state slots) are read at scrape time from a callback, so they are never stale.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from serving.probes import Probes, wsgi

if TYPE_CHECKING:  # the type only: the router reads no engine-loop state
    from serving.commands import Snapshot

log = logging.getLogger("pdserve.metrics")

OUTCOMES = ("ok", "error", "cancelled")
_LAT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# name -> (help, value): a number, or {label value: number} for one series per label value
Gauges = Mapping[str, tuple[str, float | Mapping[int, float]]]


class _Gauges:
    """A collector whose gauges come from `read()` -> {name: (help, value)} at every scrape; a
    name ending in `_total` is a counter (a running total the engine keeps). A value that is a
    dict {label value: v} is one series per label value, labelled `position`."""

    def __init__(self, prefix: str, read: Callable[[], Gauges]) -> None:
        self.prefix, self.read = prefix, read

    def collect(self) -> Iterator[Metric]:
        try:
            vals = self.read()
        except Exception:  # a scrape must not fail because a node is stopping
            log.debug("metrics gauge read failed", exc_info=True)
            return
        for name, (doc, v) in vals.items():
            if isinstance(v, Mapping):
                c = CounterMetricFamily(f"{self.prefix}_{name.removesuffix('_total')}", doc, labels=["position"])
                for label, x in v.items():
                    c.add_metric([str(label)], float(x))
                yield c
                continue
            if name.endswith("_total"):
                yield CounterMetricFamily(f"{self.prefix}_{name.removesuffix('_total')}", doc, value=float(v))
                continue
            g = GaugeMetricFamily(f"{self.prefix}_{name}", doc)
            g.add_metric([], float(v))
            yield g


class ServingMetrics:
    """The metrics of one server; `prefix` is pdserve_router / pdserve_decode / pdserve_prefill."""

    def __init__(self, prefix: str, gauges: Callable[[], Gauges] | None = None, whole: bool = False) -> None:
        """whole: the server sees each request from arrival to its last token (the router): it also
        keeps e2e_seconds and prompt_tokens_total."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{prefix}_requests", "Finished requests by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(outcome=o)
        self.ttft = Histogram(f"{prefix}_ttft_seconds", "Time to first token", buckets=_LAT_BUCKETS, registry=r)
        self.tpot = Histogram(
            f"{prefix}_tpot_seconds", "Time per output token after the first", buckets=_TPOT_BUCKETS, registry=r
        )
        self.tokens = Counter(f"{prefix}_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens: Counter | None = None  # the router's: it sees each request whole
        self.e2e: Histogram | None = None
        if whole:
            self.prompt_tokens = Counter(f"{prefix}_prompt_tokens", "Prompt tokens of finished requests", registry=r)
            self.e2e = Histogram(
                f"{prefix}_e2e_seconds", "Request received to its last token", buckets=_E2E_BUCKETS, registry=r
            )
        self.transfer_bytes = Counter(f"{prefix}_transfer_bytes", "State bytes transferred", registry=r)
        self.transfer_seconds = Counter(f"{prefix}_transfer_seconds", "Time spent transferring state", registry=r)
        self.transfers = Counter(f"{prefix}_transfers", "State transfers completed", registry=r)
        self.transfer_failures = Counter(f"{prefix}_transfer_failures", "State transfers that failed", registry=r)
        if gauges is not None:
            r.register(_Gauges(prefix, gauges))
        self._server: _ThreadingWSGIServer | None = None

    def request_done(
        self,
        outcome: str,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        tokens: int = 0,
        e2e_s: float | None = None,
        prompt_tokens: int = 0,
    ) -> None:
        self.requests.labels(outcome=outcome).inc()
        if e2e_s is not None and self.e2e is not None:
            self.e2e.observe(e2e_s)
        if prompt_tokens and self.prompt_tokens is not None:
            self.prompt_tokens.inc(prompt_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        if tokens:
            self.tokens.inc(tokens)

    def transfer_done(self, nbytes: int, seconds: float, ok: bool = True) -> None:
        if ok:
            self.transfers.inc()
            self.transfer_bytes.inc(nbytes)
            self.transfer_seconds.inc(max(0.0, seconds))
        else:
            self.transfer_failures.inc()

    def serve(self, host: str, port: int, probes: Probes | None = None) -> int:
        """Serve `/metrics` (and with `probes`, `/health` and `/live`: serving/probes.py) on host:port
        (0 picks a free port) from a daemon thread; returns the port."""
        app = make_wsgi_app(self.registry)
        server = make_server(
            host, port, app if probes is None else wsgi(app, probes), _ThreadingWSGIServer, _QuietHandler
        )
        self._server = server
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        return server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # no access log line per scrape
        pass


def capacity_gauges(snapshot: Snapshot) -> Gauges:
    """The node gauges from an engine-loop Snapshot."""
    s = snapshot
    return {
        "kv_pages_free": ("KV cache pages free", s.free_blocks),
        "kv_pages_used": ("KV cache pages in use", s.total_blocks - s.free_blocks),
        "state_slots_free": ("GDN state slots free", s.free_slots),
        "state_slots_used": ("GDN state slots in use", s.total_slots - s.free_slots),
        "running": ("Requests running", s.running),
        "queue_depth": ("Requests waiting in the engine's queue to be scheduled", s.waiting),
        "reservations": (
            "Reservations: memory set aside for a prompt a prefill node computes, until the request joins the batch",
            s.reserved,
        ),
        "queued_prefill_tokens": ("Prompt tokens waiting for prefill", s.queued_prefill_tokens),
        "prefix_hit_tokens_total": ("Prompt tokens taken from the prefix cache", s.prefix_hit_tokens),
        "prefix_miss_tokens_total": (
            "Prompt tokens not in the prefix cache (computed here, or on a decode node received by transfer)",
            s.prefix_query_tokens - s.prefix_hit_tokens,
        ),
        "prefix_held_admissions_total": (
            "Requests whose admission waited for a snapshot that a running request was computing",
            s.prefix_held_admissions,
        ),
        "prefix_snapshots_used": ("GDN state snapshots held by the prefix cache", s.prefix_snapshots_used),
        "prefix_snapshots_evicted_total": (
            "Prefix-cache snapshots dropped for newer ones (the pool is full)",
            s.prefix_snapshots_evicted,
        ),
        "prefix_pages_evicted_total": (
            "Prefix-cache pages handed out again (cached, then needed)",
            s.prefix_pages_evicted,
        ),
        "prefix_snapshot_memory_bytes": (
            "Memory of the prefix cache's GDN state snapshots held, per rank",
            s.prefix_snapshot_bytes * s.prefix_snapshots_used // max(s.prefix_snapshots, 1),
        ),
        "images_total": ("Images run through the vision encoder (an encoder-cache hit is not one)", s.images[0]),
        "encoder_seconds_total": ("Seconds in the image processor and the vision encoder", s.images[1]),
        "encoder_cache_hits_total": (
            "Image spans whose embeddings came from the encoder cache (a later chunk, an image sent again)",
            s.images[2],
        ),
        "spec_draft_tokens_total": ("Draft tokens verified (speculative decoding)", s.spec_draft_tokens),
        "spec_accepted_tokens_total": ("Draft tokens accepted (speculative decoding)", s.spec_accepted_tokens),
        "spec_position_drafts_total": (
            "Drafts verified at each place of a row (position 1 = the first draft)",
            {i + 1: v for i, v in enumerate(s.spec_drafts_per_position)},
        ),
        "spec_position_accepted_total": (
            "Drafts accepted at each place of a row (position 1 = the first draft)",
            {i + 1: v for i, v in enumerate(s.spec_accepted_per_position)},
        ),
    }
