"""The encode pool's part of a disaggregated request with images (docs/images.md, "The encode
pool"): when encode nodes are registered, before the Prefill call the router asks the chosen
prefill node which of the images its encoder cache lacks (ReserveEncoded: landing slots for
those), and one encode node to encode them and push each output into its slot (Encode). The
prefill then finds them in its encoder cache. Nothing here fails a request: no encode node, a
dead one (also one found dead while it encodes), a refused or failed call, no room at the prefill node, and the prefill node encodes
the images itself, as without the pool."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

from proto import pb
from router.config import RouterConfig
from router.registry import NodeEntry, NodeRegistry
from serving.rpc import is_draining

log = logging.getLogger("pdserve.router")

# where each image of a request prefilled on a prefill node was to be encoded
OUTCOMES = ("encode_pool", "cached", "prefill_no_pool", "prefill_fallback", "prefill_no_room")


class _Gone(Exception):
    """The encode node was marked dead (or replaced) while an Encode call to it ran."""


class EncodePool:
    def __init__(self, cfg: RouterConfig, registry: NodeRegistry, metrics: CollectorRegistry) -> None:
        self.cfg, self.registry = cfg, registry
        self.images = Counter(
            "pdserve_router_encode_images",
            "Images of prefill-node requests by where they were encoded: encode_pool (pushed by an encode node), "
            "cached (in the prefill node's encoder cache), prefill_no_pool / prefill_fallback / prefill_no_room "
            "(the prefill node encoded: no encode node, the encode call failed, no landing room)",
            ["where"],
            registry=metrics,
        )
        for w in OUTCOMES:
            self.images.labels(where=w)

    def _choose(self) -> NodeEntry | None:
        with self.registry.lock:
            nodes = self.registry.routable(pb.NODE_KIND_ENCODE)
            e = min(nodes, key=lambda n: (n.inflight, n.node_id), default=None)
            if e is not None:
                e.inflight += 1
        return e

    async def prepare(self, p: NodeEntry, rid: str, images: Sequence[pb.ImageInput]) -> list[bytes]:
        """Have an encode node push the images P lacks into P's landing slots (best effort); the
        pixel hashes pushed, for the Prefill call (PrefillRequest.encoded)."""
        unique = list({bytes(i.pixel_hash): i for i in images}.values())
        if not unique:
            return []
        if not self.registry.routable(pb.NODE_KIND_ENCODE):
            self.images.labels(where="prefill_no_pool").inc(len(unique))
            return []
        bare = [pb.ImageInput(pixel_hash=i.pixel_hash, offset=i.offset, grid_thw=i.grid_thw) for i in unique]
        try:
            r = await p.stub.ReserveEncoded(pb.ReserveEncodedRequest(request_id=rid, images=bare), timeout=10)
        except grpc.RpcError as err:
            log.warning(
                "request %s: ReserveEncoded on %s failed (%s: %s); it encodes the images itself",
                rid,
                p.node_id,
                err.code().name,
                err.details(),
            )
            self.images.labels(where="prefill_fallback").inc(len(unique))
            return []
        cached = set(r.cached)
        missing = [i for i in unique if bytes(i.pixel_hash) not in cached]
        self.images.labels(where="cached").inc(len(unique) - len(missing))
        if not missing:
            return []
        if not r.landing:
            self.images.labels(where="prefill_no_room").inc(len(missing))
            return []
        e = self._choose()
        if e is None:
            self.images.labels(where="prefill_no_pool").inc(len(missing))
            return []
        try:
            call = e.stub.Encode(
                pb.EncodeRequest(request_id=rid, images=missing, landing=r.landing), timeout=self.cfg.encode_timeout_s
            )
            got = await self._unless_gone(e, call)
        except _Gone:
            log.warning(
                "request %s: %s was marked dead during its Encode call; %s encodes the images itself",
                rid,
                e.node_id,
                p.node_id,
            )
            self.images.labels(where="prefill_fallback").inc(len(missing))
            return []
        except grpc.RpcError as err:
            self._failed(e, rid, p, err)
            self.images.labels(where="prefill_fallback").inc(len(missing))
            return []
        finally:
            with self.registry.lock:
                e.inflight -= 1
        done = len(got.images)
        self.images.labels(where="encode_pool").inc(done)
        self.images.labels(where="prefill_no_room").inc(len(missing) - done)  # no slot for them at P
        log.info("request %s: %d image(s) encoded on %s for %s", rid, done, e.node_id, p.node_id)
        return [bytes(i.pixel_hash) for i in got.images]

    async def _unless_gone(self, e: NodeEntry, call: Any) -> pb.EncodeResponse:
        """The Encode call's answer; _Gone (the call cancelled) once the node is marked dead or
        unreachable, or replaced, while it runs: a node that stopped answering (hung, paused, its
        host gone) leaves its callers to the prefill node within the heartbeats' dead_after_s, not
        after the whole --encode-timeout."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.cfg.heartbeat_interval_s)
                if done:
                    if task.cancelled():  # the node's channel closed under it (the node re-registered)
                        raise _Gone
                    return task.result()  # type: ignore[no-any-return]
                with self.registry.lock:
                    gone = not e.alive or e.unreachable or self.registry.nodes.get(e.node_id) is not e
                if gone:
                    raise _Gone
        finally:
            if not task.done():
                call.cancel()
                task.cancel()

    def _failed(self, e: NodeEntry, rid: str, p: NodeEntry, err: grpc.RpcError) -> None:
        code = err.code()
        if is_draining(err):
            self.registry.mark_draining(e)
        elif code == grpc.StatusCode.UNAVAILABLE:
            with self.registry.lock:
                e.alive = False  # back with its next heartbeat, if it is alive after all
        log.warning(
            "request %s: encode on %s failed (%s: %s); %s encodes the images itself",
            rid,
            e.node_id,
            code.name,
            err.details(),
            p.node_id,
        )
