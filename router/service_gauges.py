"""The router's gauges on its /metrics, read from the service at each scrape: queue depth,
requests in flight, live and draining nodes, the decode nodes' pages and slots (their last
heartbeats), the token streams' totals (docs/api.md, "Metrics")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from proto import pb

if TYPE_CHECKING:
    from router.service import GenerateService


def gauges(svc: GenerateService) -> dict[str, tuple[str, float]]:
    """name -> (help, value), and every gauge source the service was given (the HTTP front's)."""
    dec = svc.registry.live(pb.NODE_KIND_DECODE)
    caps = [e.info.capacity for e in dec]
    mux, cs = svc.registry.mux_totals, svc.client_streams
    out: dict[str, tuple[str, float]] = {
        "queue_depth": ("Requests waiting for admission", svc.admission.depth()),
        "active_requests": ("Requests in flight through the router", svc.active),
        "decode_nodes_live": ("Live decode nodes", len(dec)),
        "prefill_nodes_live": ("Live prefill nodes", len(svc.registry.live(pb.NODE_KIND_PREFILL))),
        "encode_nodes_live": ("Live encode nodes", len(svc.registry.live(pb.NODE_KIND_ENCODE))),
        "nodes_draining": (
            "Live nodes that drain (finish what they hold, take nothing new)",
            sum(1 for e, _ in svc.registry.snapshot() if e.alive and e.info.draining),
        ),
        "token_stream_messages_total": (
            "Messages read on the decode nodes' token streams (one per engine step with tokens)",
            mux.messages,
        ),
        "token_stream_tokens_total": ("Tokens read on the decode nodes' token streams", mux.tokens),
        "token_streams_broken_total": ("Token streams that broke with requests on them", mux.broken),
        "client_token_streams_open": ("Clients' token streams open (Generation.TokenStream)", len(cs)),
        "client_token_stream_messages_total": ("Messages sent on the clients' token streams", cs.messages),
        "client_token_stream_chunks_total": ("Chunks those messages carried", cs.deltas),
    }
    held = {
        "kv_pages": ("KV pages", "free_blocks", "total_blocks"),
        "state_slots": ("State slots", "free_slots", "total_slots"),
    }
    for name, (what, free, total) in held.items():  # over live decode nodes, as their last heartbeats said
        f, t = sum(getattr(c, free) for c in caps), sum(getattr(c, total) for c in caps)
        out[f"{name}_free"] = (f"{what} free over live decode nodes (last heartbeat)", f)
        out[f"{name}_used"] = (f"{what} in use over live decode nodes (last heartbeat)", t - f)
        out[f"{name}_usage"] = (
            f"Fraction of the {what.lower()} in use over live decode nodes, 0-1",
            (t - f) / t if t else 0.0,
        )
    for more in svc.gauge_sources:
        out.update(more())
    return out
