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
# (shared: pushed by an encode node for another request that had it encoded for the same prefill node at once)
OUTCOMES = ("encode_pool", "shared", "cached", "prefill_no_pool", "prefill_fallback", "prefill_no_room")


class _Gone(Exception):
    """The encode node was marked dead (or replaced) while an Encode call to it ran."""


class EncodePool:
    def __init__(self, cfg: RouterConfig, registry: NodeRegistry, metrics: CollectorRegistry) -> None:
        self.cfg, self.registry = cfg, registry
        self.images = Counter(
            "pdserve_router_encode_images",
            "Images of prefill-node requests by where they were encoded: encode_pool (pushed by an encode node), "
            "shared (pushed by an encode node for a concurrent request with the same image), "
            "cached (in the prefill node's encoder cache), prefill_no_pool / prefill_fallback / prefill_no_room "
            "(the prefill node encoded: no encode node, the encode call failed, no landing room)",
            ["where"],
            registry=metrics,
        )
        for w in OUTCOMES:
            self.images.labels(where=w)
        # (prefill node, pixel hash) -> where the encode in flight for it ends up (an OUTCOMES name),
        # and the request that asked for it: a push stays listed until that request's Prefill call
        # is answered (`taken`), as P notes the image cached only when a Prefill call takes it
        self._pending: dict[tuple[str, bytes], tuple[asyncio.Future[str], str]] = {}

    def _choose(self) -> NodeEntry | None:
        with self.registry.lock:
            nodes = self.registry.routable(pb.NODE_KIND_ENCODE)
            e = min(nodes, key=lambda n: (n.inflight, n.node_id), default=None)
            if e is not None:
                e.inflight += 1
        return e

    async def prepare(self, p: NodeEntry, rid: str, images: Sequence[pb.ImageInput]) -> list[bytes]:
        """Have an encode node push the images P lacks into P's landing slots (best effort); the
        pixel hashes pushed, for the Prefill call (PrefillRequest.encoded). An image another request
        is having pushed into P now is not asked for again: this one waits for that push and names
        it too (P takes it into its encoder cache once, for both)."""
        unique = list({bytes(i.pixel_hash): i for i in images}.values())
        if not unique:
            return []
        shared = {h: e[0] for i in unique if (e := self._pending.get((p.node_id, h := bytes(i.pixel_hash))))}
        own = [i for i in unique if bytes(i.pixel_hash) not in shared]
        mine = {bytes(i.pixel_hash): asyncio.get_running_loop().create_future() for i in own}
        self._pending.update({(p.node_id, h): (f, rid) for h, f in mine.items()})
        where: dict[bytes, str] = {}
        try:
            if own:
                where = await self._encode(p, rid, own)
        finally:
            for h, f in mine.items():  # the requests waiting on these go on, whatever became of them
                f.set_result(where.get(h, "prefill_fallback"))
                # one pushed waits in P's landing (its slot taken: a request that asked P now would
                # find no room) until this request's Prefill takes it: shared until `taken`
                if f.result() != "encode_pool":
                    self._drop(p.node_id, h, f)
        for h, f in shared.items():
            theirs = await asyncio.shield(f)  # this request's cancel leaves the others' wait alone
            where[h] = "shared" if theirs == "encode_pool" else theirs
        for w in where.values():
            self.images.labels(where=w).inc()
        if shared:
            log.info("request %s: %d image(s) shared with requests encoding them for %s", rid, len(shared), p.node_id)
        return [h for h, w in where.items() if w in ("encode_pool", "shared")]

    def taken(self, p: NodeEntry, rid: str) -> None:
        """The request's Prefill call on P was answered or failed: P took the images pushed for it
        into its encoder cache (ReserveEncoded names them cached now), or left them to its lease."""
        for (node, h), (f, owner) in list(self._pending.items()):
            if node == p.node_id and owner == rid:
                self._drop(node, h, f)

    def _drop(self, node: str, h: bytes, f: asyncio.Future[str]) -> None:
        if (e := self._pending.get((node, h))) is not None and e[0] is f:
            del self._pending[(node, h)]

    async def _encode(self, p: NodeEntry, rid: str, unique: list[pb.ImageInput]) -> dict[bytes, str]:
        """Where each image gets encoded (OUTCOMES): pushed by an encode node into P's landing, or
        left to P, and why."""
        hashes = [bytes(i.pixel_hash) for i in unique]
        if not self.registry.routable(pb.NODE_KIND_ENCODE):
            return dict.fromkeys(hashes, "prefill_no_pool")
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
            return dict.fromkeys(hashes, "prefill_fallback")
        cached = set(r.cached)
        where = {h: "cached" for h in hashes if h in cached}
        missing = [i for i in unique if bytes(i.pixel_hash) not in cached]
        if not missing:
            return where
        if not r.landing:
            return where | dict.fromkeys((bytes(i.pixel_hash) for i in missing), "prefill_no_room")
        e = self._choose()
        if e is None:
            return where | dict.fromkeys((bytes(i.pixel_hash) for i in missing), "prefill_no_pool")
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
            return where | dict.fromkeys((bytes(i.pixel_hash) for i in missing), "prefill_fallback")
        except grpc.RpcError as err:
            self._failed(e, rid, p, err)
            return where | dict.fromkeys((bytes(i.pixel_hash) for i in missing), "prefill_fallback")
        finally:
            with self.registry.lock:
                e.inflight -= 1
        pushed = {bytes(i.pixel_hash) for i in got.images}
        log.info("request %s: %d image(s) encoded on %s for %s", rid, len(pushed), e.node_id, p.node_id)
        # no slot at P for the rest
        return where | {
            bytes(i.pixel_hash): "encode_pool" if bytes(i.pixel_hash) in pushed else "prefill_no_room" for i in missing
        }

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
