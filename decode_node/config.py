"""DecodeNodeConfig: what one decode node runs (engine sizes) and how it joins the router."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineArgs


@dataclass(frozen=True)
class DecodeNodeConfig(EngineArgs):
    """The engine (EngineArgs: model, sizes, speculative drafts, ...) plus how the node joins the router."""

    node_id: str = "decode-0"  # unique among the router's nodes
    # Prompts shorter than this many tokens are prefilled here (conditional disaggregation);
    # 0 means always use the prefill pool (the router decides; it also prefills here when no
    # prefill node is ready).
    local_prefill_threshold: int = 0
    router: str | None = None  # host:port of the router(s) to register with (None: standalone)
    advertise_host: str = "127.0.0.1"  # the host part of the address the router dials
    heartbeat_interval_s: float = 0.5
    reservation_lease_s: float = 30.0  # default lease of a Reserve that names none
    transfer_backend: str = "nixl"  # data plane of the receiver endpoints (transfer.TRANSPORTS)
    metrics_port: int | None = None  # Prometheus /metrics on this port (0 picks one; None: off)

    def __post_init__(self):
        if self.local_prefill_threshold < 0:
            raise ValueError(f"local_prefill_threshold must be >= 0 (got {self.local_prefill_threshold})")
        if self.heartbeat_interval_s <= 0 or self.reservation_lease_s <= 0:
            raise ValueError("heartbeat_interval_s and reservation_lease_s must be positive")
