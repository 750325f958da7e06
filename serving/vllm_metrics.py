"""vLLM's metric names on pdserve's servers, for what reads them: vLLM's Grafana dashboard,
autoscalers (KEDA / HPA on `vllm:num_requests_waiting`), inference gateways' endpoint pickers and
planners (waiting, running, KV-cache usage). Same names, same meaning, same `model_name` label
(docs/api.md, "vLLM's metric names").

A disaggregated cluster keeps these figures in different places, and each server says what it
sees: a node, its own engine's queue, batch and caches (`NodeVllm`, here); the router, the
cluster's admission queue, the requests past it, the decode pool's KV cache and every
per-request series, since only the router sees a request whole (router/vllm_metrics.py).
`model_id` is the model's default name, the one `/v1/models` lists."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:  # the type only
    from serving.commands import Snapshot

LABEL = "model_name"
HF_SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")


def model_id(path: str) -> str:
    """A model's default name: ORG/NAME for a Hugging Face cache snapshot
    (`.../models--ORG--NAME/snapshots/HASH`), else the checkpoint directory's name."""
    m = HF_SNAPSHOT.search(path)
    return f"{m.group(1)}/{m.group(2)}" if m else Path(path).name


def gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=[LABEL])
    g.add_metric([model], float(value))
    return g


def counter(name: str, doc: str, model: str, value: float) -> CounterMetricFamily:
    """`name` without `_total` (the exposition adds it)."""
    c = CounterMetricFamily(name, doc, labels=[LABEL])
    c.add_metric([model], float(value))
    return c


def kv_usage(total: int, free: int) -> float:
    """vllm:kv_cache_usage_perc: the fraction of KV pages in use, 0-1 (0 with no pages)."""
    return (total - free) / total if total else 0.0


class NodeVllm:
    """A node's vLLM series, read from its engine loop's snapshot at every scrape."""

    def __init__(self, model: str, snapshot: Callable[[], Snapshot]) -> None:
        self.model, self.snapshot = model, snapshot

    def collect(self) -> Iterator[Metric]:
        s, m = self.snapshot(), self.model
        yield gauge("vllm:num_requests_running", "Requests in the engine's running batch", m, s.running)
        # vLLM counts a request whose KV a remote prefill still sends (WAITING_FOR_REMOTE_KVS) as
        # waiting: a decode node's reservations are those requests, until they join the batch
        yield gauge(
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled, reservations waiting for their state transfer included",
            m,
            s.waiting + s.reserved,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of the node's KV cache pages in use, 0-1",
            m,
            kv_usage(s.total_blocks, s.free_blocks),
        )
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", m, s.prefix_query_tokens
        )
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", m, s.prefix_hit_tokens)
        yield counter("vllm:num_preemptions", "Requests preempted (out of KV pages; they recompute)", m, s.preemptions)


def register_node(
    registry: CollectorRegistry, model_path: str, served: tuple[str, ...], snapshot: Callable[[], Snapshot]
) -> None:
    """Add a node's vLLM series to its registry, labelled as the router labels its own: the first
    served name (--served-model-name), else the model's default name."""
    registry.register(NodeVllm(served[0] if served else model_id(model_path), snapshot))
