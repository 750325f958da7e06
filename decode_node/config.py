"""DecodeNodeConfig: what one decode node runs (engine sizes) and how it joins the router."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import (
    CacheConfig,
    DTypeName,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)


@dataclass(frozen=True)
class DecodeNodeConfig:
    model: str  # checkpoint directory
    node_id: str = "decode-0"  # unique among the router's nodes
    tensor_parallel_size: int = 1  # worker processes (ranks) of this node
    dtype: DTypeName = "auto"
    kv_cache_memory: str = "256MiB"  # KV pages + GDN state slots, per rank
    max_num_seqs: int = 64  # running batch (and GDN state slots)
    max_num_batched_tokens: int = 2048  # token budget of one engine step
    block_size: int = 16
    max_model_len: int | None = None
    seed: int = 0
    device: str = "cpu"
    # Prompts shorter than this many tokens are prefilled here (conditional disaggregation);
    # 0 means always use the prefill pool (the router decides; it also prefills here when no
    # prefill node is ready).
    local_prefill_threshold: int = 0
    router: str | None = None  # host:port of the router to register with (None: standalone)
    advertise_host: str = "127.0.0.1"  # the host part of the address the router dials
    heartbeat_interval_s: float = 0.5
    reservation_lease_s: float = 30.0  # default lease of a Reserve that names none
    transfer_backend: str = "nixl"  # data plane of the receiver endpoints (transfer.TRANSPORTS)
    metrics_port: int | None = None  # Prometheus /metrics on this port (0 picks one; None: off)
    num_speculative_tokens: int = 0  # n-gram drafts verified per decode row (prefill nodes must match)

    def __post_init__(self):
        if self.local_prefill_threshold < 0:
            raise ValueError(f"local_prefill_threshold must be >= 0 (got {self.local_prefill_threshold})")
        if self.heartbeat_interval_s <= 0 or self.reservation_lease_s <= 0:
            raise ValueError("heartbeat_interval_s and reservation_lease_s must be positive")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig.from_dir(self.model, self.dtype),
            parallel=ParallelConfig(self.tensor_parallel_size),
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory),
            scheduler=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len),
            device=self.device,
            seed=self.seed,
            speculative=SpeculativeConfig(num_tokens=self.num_speculative_tokens),
        )
