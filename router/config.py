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
    # Admission (router/admission.py): requests wait in FIFO order for room, at most this long,
    # then RESOURCE_EXHAUSTED; a request that finds max_queued_requests waiting is refused at once.
    admission_timeout_s: float = 30.0
    max_queued_requests: int = 512  # 0: no limit
    # Prompt tokens the router keeps outstanding on one prefill node (sent, first token not back);
    # beyond it requests wait in the admission queue and reserve no decode memory. A prompt larger
    # than the window still goes to an idle node. 0: no window (reserve at once for everything).
    prefill_window_tokens: int = 8192
    policy: str = "least-loaded"
    # Lease asked of a decode node's Reserve: the prefill node renews it every third of it while it
    # works on the request, so it only runs out when that node stops (dead or hung).
    reservation_lease_s: float = 15.0
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
        if self.max_queued_requests < 0 or self.prefill_window_tokens < 0:
            raise ValueError("max_queued_requests and prefill_window_tokens must be >= 0 (0: no limit)")
        if self.reservation_lease_s <= 0:
            raise ValueError(f"reservation_lease_s must be positive (got {self.reservation_lease_s})")
        if self.max_prefill_queue_tokens < 0:
            raise ValueError("max_prefill_queue_tokens must be >= 0 (0: no limit)")
        make_policy(self.policy)
