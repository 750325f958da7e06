"""EncodeNodeConfig: what one encode node runs (the checkpoint's vision tower and processor) and
how it joins the router and pushes. Every field is an option of `pdserve encode` and of
`pdserve up --encode N`; of the engine options only the model, dtype and device matter here."""

from __future__ import annotations

from dataclasses import dataclass

from engine.options import option
from engine.units import parse_bytes
from serving.config import NodeArgs


@dataclass(frozen=True)
class EncodeNodeConfig(NodeArgs):
    """How the node joins the router (NodeArgs) and pushes encoder outputs."""

    node_id: str = option("encode-0", "unique among the router's nodes")
    encode_staging_memory: int | str = option(
        "64MiB", "host memory registered for outputs on their way out (the largest image's output must fit)"
    )
    encode_push_timeout_s: float = option(10.0, "seconds one image's WRITE may take before the Encode call fails")

    def __post_init__(self) -> None:
        super().__post_init__()
        if parse_bytes(self.encode_staging_memory) <= 0 or self.encode_push_timeout_s <= 0:
            raise ValueError("encode_staging_memory and encode_push_timeout_s must be positive")
        if self.tensor_parallel_size != 1:
            raise ValueError("an encode node runs the encoder on one rank (--tp 1); run more encode nodes instead")
