"""One image in a prompt, as the router hands it to the node that prefills the prompt: the
client's encoded bytes, a hash of the decoded pixels (the identity the encoder cache and the
prefix cache key on), where its placeholder tokens start and its patch grid (docs/images.md)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ImageInput"]


@dataclass(frozen=True)
class ImageInput:
    data: bytes  # the encoded image (PNG, JPEG, WebP, ...) as the client sent it
    pixel_hash: bytes  # SHA-256 of the decoded RGB pixels and their size (32 bytes)
    offset: int  # index in prompt_token_ids of the image's first placeholder (<|image_pad|>) token
    grid_thw: tuple[int, int, int]  # patch grid (t, h, w) before the merge, from the processor's resize

    def num_tokens(self, merge_size: int) -> int:
        """Placeholder tokens the image takes in the prompt: one per merged patch."""
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)
