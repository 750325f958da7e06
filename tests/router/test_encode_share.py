"""The encode pool's sharing of one push (router/encode.py) against stand-in prefill and encode
node stubs: a request with the same new image as another whose push has landed, but whose Prefill
call has not reached the prefill node yet, shares that push instead of finding the image's
landing slot taken (prefill_no_room: the prefill node would encode it a second time); once the
first request's Prefill is answered, the prefill node's encoder cache holds the image and the
next request finds it there."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from proto import pb
from router.config import RouterConfig
from router.encode import OUTCOMES, EncodePool
from router.policy import make_policy
from router.prefill import PrefillPhase
from router.registry import NodeRegistry

HASH = b"h" * 32


class _Prefill:
    """ReserveEncoded as prefill_node/encoded.py answers it: hashes a Prefill call took are cached;
    an image with a landing slot (reserved or landed, not yet taken) gets no second slot. Prefill
    takes the pushed outputs it names (their slots freed) once `arrive` is set: until then the
    call is on its way (the router's handshake and reservation come first)."""

    def __init__(self):
        self.seen: set[bytes] = set()
        self.slots: set[bytes] = set()
        self.reserve_calls = 0
        self.prefills: list[str] = []
        self.arrive = asyncio.Event()

    async def ReserveEncoded(self, req, timeout=None):
        self.reserve_calls += 1
        hashes = [bytes(i.pixel_hash) for i in req.images]
        new = [h for h in hashes if h not in self.seen and h not in self.slots]
        self.slots.update(new)
        return pb.ReserveEncodedResponse(cached=[h for h in hashes if h in self.seen], landing=b"t" if new else b"")

    def Prefill(self, req, timeout=None):
        node = self
        self.prefills.append(req.request_id)

        class _Call:
            async def read(self):
                await node.arrive.wait()
                node.slots.difference_update(req.encoded)
                node.seen.update(bytes(i.pixel_hash) for i in req.images)
                return pb.PrefillResponse(first_token_id=7, finish_reason="length")

            def cancel(self):
                pass

        return _Call()


class _Encode:
    def __init__(self):
        self.calls = 0

    def Encode(self, req, timeout=None):
        self.calls += 1

        async def answer():
            return pb.EncodeResponse(images=[pb.EncodedImage(pixel_hash=i.pixel_hash) for i in req.images])

        return answer()


def test_a_push_not_yet_taken_is_shared_then_found_cached():
    reg = NodeRegistry()
    p = reg.register(pb.NodeInfo(node_id="p", kind=pb.NODE_KIND_PREFILL, prefill_ready=True))
    e = reg.register(pb.NodeInfo(node_id="e", kind=pb.NODE_KIND_ENCODE))
    metrics = CollectorRegistry()
    phase = PrefillPhase(RouterConfig(), reg, make_policy("least-loaded"), lambda coro: None)
    images = [pb.ImageInput(data=b"png", pixel_hash=HASH, offset=3, grid_thw=[1, 4, 4])]
    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=1))

    async def go():
        p._stub, e._stub = _Prefill(), _Encode()
        phase.encode = pool = EncodePool(RouterConfig(), reg, metrics)
        chosen = phase.choose(None, 40, set(), window=True)
        assert chosen is not None
        first = asyncio.ensure_future(phase.alone(chosen, req, list(range(40)), "a", images))
        while not p._stub.prefills:  # a's image pushed, its Prefill call on its way
            await asyncio.sleep(0.01)
        shared = await pool.prepare(p, "b", images)
        p._stub.arrive.set()
        assert (await first).finish_reason == "length"
        cached = await pool.prepare(p, "c", images)
        return shared, cached

    shared, cached = asyncio.run(go())
    assert shared == [HASH]  # named in b's Prefill: the prefill node takes the one push for both
    assert cached == []  # in the encoder cache: nothing to push
    assert (e._stub.calls, p._stub.reserve_calls) == (1, 2)  # a asked for the slot and c; b asked nothing
    where = {w: metrics.get_sample_value("pdserve_router_encode_images_total", {"where": w}) for w in OUTCOMES}
    assert where == dict.fromkeys(OUTCOMES, 0.0) | {"encode_pool": 1.0, "shared": 1.0, "cached": 1.0}, where
