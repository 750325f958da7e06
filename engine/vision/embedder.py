"""A rank's image side of a step: for each prefill row chunk that covers image placeholders,
the image's embeddings (from the encoder cache, or the processor + encoder once per image) and
the step's token rows they replace (docs/images.md "Prefill")."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.config import ModelConfig
from engine.step import ImageSpan
from engine.vision.cache import EncoderCache
from engine.vision.encoder import VisionEncoder
from engine.vision.processing import load_processor, pixel_values
from engine.vision.weights import load_vision_weights


class ImageEmbedder:
    def __init__(self, cfg: ModelConfig, cache_bytes: int, device):
        assert cfg.vision is not None
        self.path, self.device = cfg.path, device
        self.encoder = VisionEncoder(
            cfg.vision, load_vision_weights(cfg.path, cfg.vision, cfg.dtype, device), cfg.dtype, device
        )
        self.cache = EncoderCache(cache_bytes)
        load_processor(cfg.path)  # at start, not on the first image
        self.images = 0  # images encoded
        self.seconds = 0.0  # in the processor and the encoder
        self.received = 0  # images whose output an encode node sent (put_encoded)

    def embeddings(self, span: ImageSpan) -> torch.Tensor:
        """[tokens of the image, hidden] in the model's dtype."""
        img = span.image
        got = self.cache.get(img.pixel_hash)
        if got is None:
            t0 = time.perf_counter()
            got = self.encoder.encode(pixel_values(self.path, img), img.grid_thw)
            self.seconds += time.perf_counter() - t0
            self.images += 1
            self.cache.put(img.pixel_hash, got)
        return got

    def rows(self, spans: Sequence[tuple[int, ImageSpan]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(token indices [K] in the step, embeddings [K, hidden]) for (the step's index of the
        row's first token, span) pairs."""
        idx, emb = [], []
        for first, s in spans:
            at = first + s.at
            idx.append(torch.arange(at, at + s.hi - s.lo))
            emb.append(self.embeddings(s)[s.lo : s.hi])
        return torch.cat(idx).to(self.device), torch.cat(emb)


def put_encoded(worker, pixel_hash: bytes, embeddings: torch.Tensor) -> bool:
    """Keep an image's embeddings computed elsewhere (an encode node's, docs/images.md "The encode
    pool") in this rank's encoder cache (Worker.call); False when the model has no vision tower
    or the tensor is not [tokens, out_hidden_size] in the model's dtype."""
    emb = getattr(worker, "images", None)
    if emb is None:
        return False
    hidden = emb.encoder.cfg.out_hidden_size
    if embeddings.dim() != 2 or embeddings.shape[1] != hidden or embeddings.dtype != emb.encoder.dtype:
        return False
    emb.cache.put(pixel_hash, embeddings.to(emb.device))
    emb.received += 1
    return True


def image_stats(worker) -> dict[str, float]:
    """A rank's image counters (Worker.call): images encoded, seconds in the processor and the
    encoder, encoder-cache hits; zeros for a model without a vision tower."""
    emb = getattr(worker, "images", None)
    if emb is None:
        return {"images": 0, "encoder_seconds": 0.0, "encoder_cache_hits": 0}
    return {"images": emb.images, "encoder_seconds": emb.seconds, "encoder_cache_hits": emb.cache.hits}
