"""The prefill node's side of the encode pool (docs/images.md, "The encode pool"): its landing
region (transfer/encoded/landing.py), the ReserveEncoded answer (which images the encoder cache
holds, slots for the others), and, before a Prefill, each pushed image's landed output put into
every rank's encoder cache; an image that did not land is encoded by the prefill as before.

Neither waits on the engine loop: which images the ranks' caches hold is kept here, in the same
byte budget and least-recently-used order, from the images of the Prefill calls (a guess that
errs only towards encoding an image twice), and the outputs go into the caches by a command
posted just before the request's, which the loop runs first."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future

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
from transfer.encoded.landing import Landed, Landing, install
from transfer.encoded.messages import encode_target, vision_digest

log = logging.getLogger("pdserve.prefill")


class EncodedInputs:
    """Owns the landing (None for a model without a vision tower or with the region off)."""

    def __init__(self, cfg: PrefillNodeConfig, ecfg: EngineConfig, loop: EngineLoop, metrics: ServingMetrics) -> None:
        m, size = ecfg.model, parse_bytes(cfg.encoder_landing_memory)
        self.cfg, self.loop = cfg, loop
        self.merge = m.vision.spatial_merge_size if m.vision is not None else 1
        self.landing: Landing | None = None
        # encoder outputs land over NIXL whichever backend moves the KV pages and states
        if m.vision is not None and size > 0:
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
        self.cache_budget = parse_bytes(ecfg.cache.encoder_cache_memory)
        self.row_bytes = (m.vision.out_hidden_size if m.vision is not None else 0) * m.dtype.itemsize
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # what the ranks' encoder caches hold, by pixel hash
        self._seen_bytes = 0
        self._lock = threading.Lock()
        self._claims: dict[bytes, threading.Event] = {}  # outputs a Prefill call is taking now, by pixel hash
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
        with self._lock:
            cached = {h for h in hashes if h in self._seen}
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
            key = img.pixel_hash
            with self._lock:  # one request takes an output that several name (the router shares a push)
                claim, mine = self._claims.get(key), key not in self._claims
                if mine:
                    claim = self._claims[key] = threading.Event()
            assert claim is not None
            if not mine:  # set once its install is queued on the loop, ahead of this request's prefill
                claim.wait(max(0.0, deadline - time.monotonic()))
                continue
            try:
                got = land.take(key, max(0.0, deadline - time.monotonic()))
                if got is None:
                    continue
                done = self.loop.run(lambda e, g=got: install(e, g))  # type: ignore[misc]
                done.add_done_callback(lambda f, g=got: self._installed(rid, g, f))  # type: ignore[misc]
            finally:
                with self._lock:
                    del self._claims[key]
                claim.set()

    def _installed(self, rid: str, got: Landed, f: Future[bool]) -> None:
        if f.exception() is None and f.result():
            self.received.inc()
            log.info("request %s: image %s encoded on %s", rid, got.pixel_hash[:6].hex(), got.src)

    def note(self, images: Sequence[ImageInput]) -> None:
        """The images of a Prefill call: the ranks' encoder caches hold them now (or soon)."""
        with self._lock:
            for img in images:
                if img.pixel_hash in self._seen:
                    self._seen.move_to_end(img.pixel_hash)
                    continue
                size = img.num_tokens(self.merge) * self.row_bytes
                if size > self.cache_budget:
                    continue
                self._seen[img.pixel_hash] = size
                self._seen_bytes += size
                while self._seen_bytes > self.cache_budget:
                    self._seen_bytes -= self._seen.popitem(last=False)[1]

    def close(self) -> None:
        if self.landing is not None:
            self.landing.close()
