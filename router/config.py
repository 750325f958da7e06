"""RouterConfig: what one router runs with (admission, policy, timeouts, ports)."""

from __future__ import annotations

from dataclasses import dataclass

from router.policy import make_policy


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
