"""The encode node's gRPC server, `serve(addr, cfg) -> (node, port)`: it loads only the
checkpoint's vision tower and image processor, registers with the router as an ENCODE node, and
answers Encode: each image's bytes are checked (decoded, hashed, sized), run through the
processor and the encoder, and pushed into the slot the prefill node reserved for it
(transfer/encoded/pusher.py). Any failure is a status; the router then lets the prefill node
encode the image itself. The node holds no engine loop and no KV: the lifecycle it shares with
the other nodes is serving/node.py's."""

from __future__ import annotations

import logging
import os
import threading
import time

import grpc
import msgspec

from encode_node.config import EncodeNodeConfig
from engine.config import dtype_name
from engine.devices import node_devices
from engine.units import parse_bytes
from engine.vision.encoder import VisionEncoder
from engine.vision.processing import load_processor, pixel_values
from engine.vision.weights import load_vision_weights
from proto import pb, rpc
from serving.metrics import Gauges, ServingMetrics
from serving.node import NodeServer, serve_node
from serving.rpc import images_of
from transfer.encoded.messages import LandingTarget, decode_target, vision_digest
from transfer.encoded.pusher import Pusher, PushError

log = logging.getLogger("pdserve.encode")


class EncodeNode(NodeServer, rpc.EncodeNodeServicer):
    KIND = "encode"
    SERVICE = "EncodeNode"
    NODE_KIND = pb.NODE_KIND_ENCODE
    cfg: EncodeNodeConfig

    def __init__(self, cfg: EncodeNodeConfig) -> None:
        self._init_lifecycle()
        self.cfg = cfg
        self.ecfg = cfg.engine_config()
        m = self.ecfg.model
        if m.vision is None:
            raise ValueError(f"{m.path} has no vision tower (or no preprocessor_config.json): nothing to encode")
        self.vision, self.dtype, self.path = m.vision, m.dtype, m.path
        self.device = node_devices(self.ecfg.device, 1)[0]
        self.incarnation = int.from_bytes(os.urandom(7), "little")
        self.backend = cfg.transfer_backend
        self.digest = vision_digest(m.vision, dtype_name(m.dtype))
        weights = load_vision_weights(m.path, m.vision, m.dtype, self.device)
        self.encoder = VisionEncoder(m.vision, weights, m.dtype, self.device)
        load_processor(m.path)  # at start, not on the first image
        self.pusher = Pusher(cfg.node_id, parse_bytes(cfg.encode_staging_memory), self.digest, cfg.data_host)
        self.connector = None
        self._lock = threading.Lock()
        self._encode = threading.Lock()  # one image through the encoder at a time (it uses every core)
        self._calls = 0  # Encode calls in flight (guarded by _lock)
        self.images = 0
        self.seconds = 0.0
        self.pushed_bytes = 0
        self.push_seconds = 0.0
        self.failures = 0
        self.metrics = ServingMetrics("pdserve_encode", self._gauges)

    def _gauges(self) -> Gauges:
        return {
            "images_total": ("Images run through the vision encoder here", self.images),
            "encoder_seconds_total": ("Seconds in the image processor and the vision encoder", self.seconds),
            "pushed_bytes_total": ("Encoder-output bytes written into prefill nodes", self.pushed_bytes),
            "push_seconds_total": ("Seconds in those WRITEs", self.push_seconds),
            "push_failures_total": ("Encode calls that failed (the prefill node encoded instead)", self.failures),
            "running": ("Encode calls in flight", self._calls),
        }

    # ---- what the node reports ----------------------------------------------------------------
    def info(self) -> pb.NodeInfo:
        return pb.NodeInfo(
            node_id=self.cfg.node_id,
            kind=self.NODE_KIND,
            address=self.address,
            incarnation=self.incarnation,
            tp_size=1,
            model=self.cfg.model,
            schema_digest=self.digest,
            draining=self.draining,
            capacity=pb.Capacity(running=self._calls),
        )

    def summary(self) -> str:
        return f"vision encoder, {dtype_name(self.dtype)} on {self.device}; no KV"

    def in_flight(self) -> int:
        with self._lock:
            return self._calls

    def handler_threads(self) -> int:
        return 16

    def _add_servicer(self, server: grpc.Server) -> None:
        rpc.add_EncodeNodeServicer_to_server(self, server)

    def _stop_work(self) -> None:
        pass

    def _close(self) -> None:
        self.pusher.close()

    # ---- Encode -------------------------------------------------------------------------------
    def Encode(self, request: pb.EncodeRequest, context: grpc.ServicerContext) -> pb.EncodeResponse:
        self.refuse_if_draining(context)
        try:
            target = decode_target(request.landing)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"landing is not a LandingTarget: {e}")
        images = images_of(request.images, context, model=self.path)
        slots = {s.pixel_hash: s for s in target.slots}
        with self._lock:
            self._calls += 1
        ok = False
        try:
            self.pusher.check(target, self.dtype, self.vision.out_hidden_size)
            out = [
                self._one(request.request_id, target, img, slots[img.pixel_hash])
                for img in images
                if img.pixel_hash in slots
            ]
            ok = True
            return pb.EncodeResponse(images=out)
        except PushError as e:
            self.pusher.forget(target.node)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.name}: {e}")
            raise
        finally:
            with self._lock:
                self._calls -= 1
                self.failures += not ok
            self.changes.changed()

    def _one(self, rid: str, target: LandingTarget, img, slot) -> pb.EncodedImage:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        with self._encode:
            emb = self.encoder.encode(pixel_values(self.path, img), img.grid_thw)
        t1 = time.perf_counter()
        n = self.pusher.push(target, slot, list(img.grid_thw), emb, self.cfg.encode_push_timeout_s)
        t2 = time.perf_counter()
        self.images += 1
        self.seconds += t1 - t0
        self.pushed_bytes += n
        self.push_seconds += t2 - t1
        log.info(
            "request %s: image %s encoded here (%d tokens, %.1f ms), pushed to %s (%d B in %.1f ms)",
            rid,
            img.pixel_hash[:6].hex(),
            emb.shape[0],
            (t1 - t0) * 1e3,
            target.node,
            n,
            (t2 - t1) * 1e3,
        )
        return pb.EncodedImage(pixel_hash=img.pixel_hash, nbytes=n, encode_s=t1 - t0, push_s=t2 - t1)


def serve(addr: str, cfg: EncodeNodeConfig) -> tuple[EncodeNode, int]:
    return serve_node(EncodeNode(cfg), addr)


__all__ = ["EncodeNode", "serve"]
