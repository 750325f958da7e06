"""The prefill node's side of the encode pool (docs/images.md, "The encode pool"): its landing
region (transfer/encoded/landing.py), the ReserveEncoded answer (which images the encoder cache
holds, slots for the others), and, before a Prefill, each reserved image's landed output put into
every rank's encoder cache; an image that did not land is encoded by the prefill as before."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import grpc
from prometheus_client import Counter

from engine.config import EngineConfig, dtype_name
from engine.units import parse_bytes
from engine.vision.inputs import ImageInput
from prefill_node.config import PrefillNodeConfig
from proto import pb
from serving.loop import EngineLoop
from serving.metrics import ServingMetrics
from serving.rpc import images_of
from transfer.encoded.landing import Landing, cached_encoded, install
from transfer.encoded.messages import encode_target, vision_digest

log = logging.getLogger("pdserve.prefill")


class EncodedInputs:
    """Owns the landing (None for a model without a vision tower or with the region off)."""

    def __init__(self, cfg: PrefillNodeConfig, ecfg: EngineConfig, loop: EngineLoop, metrics: ServingMetrics) -> None:
        m, size = ecfg.model, parse_bytes(cfg.encoder_landing_memory)
        self.cfg, self.loop = cfg, loop
        self.merge = m.vision.spatial_merge_size if m.vision is not None else 1
        self.landing: Landing | None = None
        if m.vision is not None and size > 0 and cfg.transfer_backend == "nixl":
            digest = vision_digest(m.vision, dtype_name(m.dtype))
            self.landing = Landing(
                cfg.node_id,
                size,
                digest,
                m.dtype,
                m.vision.out_hidden_size,
                ecfg.parallel.tensor_parallel_size,
                cfg.data_host,
            )
        self.received = Counter(
            "pdserve_prefill_images_received",
            "Images whose encoder output an encode node pushed here (not encoded on this node)",
            registry=metrics.registry,
        )

    def reserve(self, request: pb.ReserveEncodedRequest, context: grpc.ServicerContext) -> pb.ReserveEncodedResponse:
        if self.landing is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.cfg.node_id} takes no encoder outputs")
            raise AssertionError  # abort raised
        land = self.landing
        images = images_of(request.images, context, need_data=False)
        hashes = list(dict.fromkeys(i.pixel_hash for i in images))
        cached = set(self.loop.call(lambda e: cached_encoded(e, hashes), timeout=10))
        grids = {i.pixel_hash: i for i in images}
        wants = [(h, grids[h].num_tokens(self.merge)) for h in hashes if h not in cached]
        target = land.reserve(wants, self.cfg.encoder_landing_lease_s)
        return pb.ReserveEncodedResponse(
            cached=[h for h in hashes if h in cached], landing=encode_target(target) if target.slots else b""
        )

    def take(self, rid: str, images: Sequence[ImageInput], encoded: Sequence[bytes]) -> None:
        """Put the landed output of each image an encode node pushed for this request (`encoded`,
        as the router says) into the ranks' encoder caches, waiting at most --encoded-wait in all
        for their notifications; what does not land is encoded by the prefill."""
        land = self.landing
        pushed = set(encoded)
        if land is None or not pushed:
            return
        deadline = time.monotonic() + self.cfg.encoded_wait_s
        for img in {i.pixel_hash: i for i in images if i.pixel_hash in pushed}.values():
            got = land.take(img.pixel_hash, max(0.0, deadline - time.monotonic()))
            if got is None:
                continue
            if self.loop.call(lambda e, g=got: install(e, g), timeout=30):  # type: ignore[misc]
                self.received.inc()
                log.info("request %s: image %s encoded on %s", rid, img.pixel_hash[:6].hex(), got.src)

    def close(self) -> None:
        if self.landing is not None:
            self.landing.close()
