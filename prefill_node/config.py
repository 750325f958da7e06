"""PrefillNodeConfig: what one prefill node runs (engine sizes), how it joins the router and pushes.

Every field is an option of `pdserve prefill` and `pdserve up` (engine/options.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.options import option
from engine.units import parse_bytes
from serving.config import NodeArgs


@dataclass(frozen=True)
class PrefillNodeConfig(NodeArgs):
    """The engine (EngineArgs; num_speculative_tokens must equal the decode nodes', it sizes the
    state pools the transfer schema describes), how the node joins the router (NodeArgs), and how
    it pushes."""

    node_id: str = option("prefill-0", "unique among the router's nodes")
    push_timeout_s: float = option(60.0, "seconds a push may take (done and quiet) before the call fails")
    # Between engine steps the loop keeps polling in-flight pushes this long (grants and write
    # completions otherwise wait for the next, possibly long, prefill step).
    push_spin_s: float = option(0.005, "seconds to keep polling posted pushes between engine steps")
    # A prompt of several chunks writes each finished chunk's full KV pages to the decode node
    # while later chunks compute (docs/transfer.md, "KV streamed per chunk"); off: one push once prefilled.
    stream_kv: bool = option(True, "write each finished prefill chunk's KV pages to the decode node at once")
    # With stream_kv, the last chunk's state goes layer by layer as its forward finishes each layer
    # (docs/transfer.md, "The last chunk, layer by layer"); off: all of it once the first token exists.
    kv_by_layer: bool = option(True, "write the last prefill chunk's KV and GDN state layer by layer as computed")
    # A float32 GDN state sent to a decode node that keeps it in bfloat16 (--mamba-ssm-cache-dtype) is cast
    # into a bfloat16 staging slot per GDN layer first (transfer/staging.py); the slots come out of the cache
    # budget where this node's state is float32, and a push finding none free waits for one.
    transfer_staging_slots: int = option(
        4,
        "bfloat16 staging slots for pushing a float32 GDN state to bfloat16 decode nodes, one request each; "
        "taken from the cache budget when this node's state is float32 (the memory plan shows them)",
    )

    # The encode pool (docs/images.md): a host region encode nodes WRITE image encoder outputs into.
    encoder_landing_memory: int | str = option(
        "64MiB", "vision-language models: host memory encode nodes push encoder outputs into (0: take none)"
    )
    encoder_landing_lease_s: float = option(
        30.0, "seconds a landing slot waits for its encode node's WRITE before it is given to others"
    )
    encoded_wait_s: float = option(
        1.0, "seconds a Prefill waits for a reserved image's output to land before it encodes the image itself"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transfer_staging_slots < 1:
            raise ValueError(f"--transfer-staging-slots must be at least 1 (got {self.transfer_staging_slots})")
        if self.push_timeout_s <= 0 or self.push_spin_s < 0:
            raise ValueError("push_timeout_s must be positive and push_spin_s >= 0")
        if parse_bytes(self.encoder_landing_memory) < 0 or self.encoder_landing_lease_s <= 0 or self.encoded_wait_s < 0:
            raise ValueError("encoder_landing_memory and encoded_wait_s must be >= 0, encoder_landing_lease_s positive")

    def engine_config(self, check_only: bool = False) -> EngineConfig:
        """The engine's, its budget paying for the transfer's staging slots."""
        cfg = super().engine_config(check_only)
        return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, staging_slots=self.transfer_staging_slots))
