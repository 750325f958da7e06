"""What the router itself holds against each node, as gauges labelled `node` and `kind`, read from
the registry at every scrape: requests placed there and not ended, the KV blocks counted against
a decode node for them, the prompt tokens sent to be computed whose first token is not back, and
whether the node is live. Every node the registry knows is listed, dead ones too (forgotten after
10 minutes): a count that stays above zero on an idle node is a request the router still holds
(docs/api.md, "Prometheus metrics")."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from proto import pb
from router.registry import NodeRegistry

KINDS: dict[int, str] = {pb.NODE_KIND_DECODE: "decode", pb.NODE_KIND_PREFILL: "prefill", pb.NODE_KIND_ENCODE: "encode"}
PREFIX = "pdserve_router_node"
HELP = {
    "inflight_requests": "Requests the router placed on the node that have not ended (decode nodes; Encode calls)",
    "inflight_blocks": "KV blocks the router counts against the node for them",
    "inflight_prefill_tokens": "Prompt tokens the router sent the node to compute whose first token is not back",
    "up": "1: the node is live (heartbeats arrive), 0: declared dead",
}


class InflightGauges:
    def __init__(self, registry: NodeRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        fams = {name: GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["node", "kind"]) for name, doc in HELP.items()}
        with self.registry.lock:
            for e in self.registry.nodes.values():
                labels = [e.node_id, KINDS.get(e.kind, "unknown")]
                fams["inflight_requests"].add_metric(labels, e.inflight)
                fams["inflight_blocks"].add_metric(labels, e.inflight_blocks)
                fams["inflight_prefill_tokens"].add_metric(labels, e.inflight_prefill_tokens)
                fams["up"].add_metric(labels, 1.0 if e.alive else 0.0)
        yield from fams.values()
