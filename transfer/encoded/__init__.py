"""The encoder-output state kind: an image's vision-encoder output pushed from an encode node to
the prefill node that will prefill it, over its own NIXL agents (docs/images.md, "The encode
pool"). `messages` holds the typed records, `landing` the prefill side (a registered host region
that encode nodes WRITE into, checked and taken into the ranks' encoder caches), `pusher` the
encode side (a registered staging region and one WRITE plus notification per image)."""

from transfer.encoded.messages import (
    ENCODED_VERSION,
    EncodedOutput,
    EncodedTensor,
    LandingSlot,
    LandingTarget,
    vision_digest,
)

__all__ = ["ENCODED_VERSION", "EncodedOutput", "EncodedTensor", "LandingSlot", "LandingTarget", "vision_digest"]
