"""A float32 prefill node feeding a bfloat16 decode node (--mamba-ssm-cache-dtype): the plan casts
the GDN recurrent state, the sender rounds the request's slot into a registered bfloat16 staging
region after the step and writes from there. Real endpoints on loopback (NIXL and UCXX), TP
1 -> 1, 2 -> 1 and 1 -> 2; each destination slot is compared with `torch.Tensor.to(torch.bfloat16)`
of the source's float32 state. The conv state and KV pages move unchanged (checked bit for bit by
the checksum, which covers every written byte)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from engine.shard import head_range
from tests.helpers.xfer_state import engine_cfg, global_state, make_pools, noise, place, tiny_model
from tests.transfer.test_transfer_local import _drive
from transfer import HandshakeError, Receiver, Sender, TransferConfig
from transfer.handshake import check_peer
from transfer.plan import pair_templates
from transfer.schema import build_schema

pytestmark = pytest.mark.timeout(120)
TOKENS = 15


def _bf16_state(cfg):
    return replace(cfg, cache=replace(cfg.cache, recurrent_dtype="bfloat16"))


CUDA = pytest.param(
    "nixl",
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    id="nixl-vram",
)


@pytest.mark.parametrize("backend,device", [("nixl", "cpu"), ("ucxx", "cpu"), CUDA], ids=["nixl", "ucxx", "nixl-vram"])
@pytest.mark.parametrize("a,b", [(1, 1), (2, 1), (1, 2)], ids=["tp1-to-1", "tp2-to-1", "tp1-to-2"])
def test_float32_state_lands_as_its_bfloat16_cast(backend, device, a, b):
    """Each destination rank's slot holds its heads of the state cast to bfloat16 (the shard map
    of engine.shard, not the plan's); on the GPU the cast runs on the device after the fence and
    has landed before the WRITE."""
    model = tiny_model()
    tc = TransferConfig(backend=backend, checksum=True)
    sc, dc = engine_cfg(model, a), _bf16_state(engine_cfg(model, b))
    rxs, txs = [], []
    try:
        for rank in range(b):
            dp = make_pools(dc, rank, device)
            noise(dp, 10 + rank)
            rxs.append(Receiver(dc, rank, dp, "D", tc))
        state = global_state(model, TOKENS, 4, 5)
        fills = []
        for rank in range(a):
            sp = make_pools(sc, rank, device)
            noise(sp, 1 + rank)
            tx = Sender(sc, rank, sp, "P", tc)
            txs.append(tx)
            for rx in rxs:
                tx.add_peer(rx.metadata())
                rx.add_peer(tx.metadata())
            blocks, slot = tx.blocks.allocate(-(-TOKENS // 4)), tx.slots.allocate()
            place(tx.pools, sc, rank, state, blocks, slot)
            fills.append((blocks, slot))
        assert {p.cast for p in txs[0].peers[rxs[0].agent].pairs if p.kind == "gdn_recurrent"} == {"bfloat16"}
        rs = [rx.reserve("q", TOKENS) for rx in rxs]
        target = rxs[0].target([r.target for r in rs], "q", TOKENS)
        sends = [tx.send("q", target, bl, sl, TOKENS, owned=True) for tx, (bl, sl) in zip(txs, fills)]
        _drive(
            *txs,
            *rxs,
            until=lambda: all(s.state.terminal and s.quiet for s in sends) and all(r.state.terminal for r in rs),
        )
        states = [s.state.value for s in sends] + [r.state.value for r in rs]
        assert states == ["done"] * (a + b), ([s.error for s in sends], [r.error for r in rs])
        for rank, (rx, r) in enumerate(zip(rxs, rs)):
            heads = list(head_range(model.linear_num_value_heads, b, rank))
            for layer, rec in state["rec"].items():
                got = rx.pools.recurrent[layer][r.slot].cpu()
                assert got.dtype == torch.bfloat16
                want = rec[heads].to(torch.bfloat16)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (rank, layer)
        for tx in txs:  # the source pool keeps its float32 state; its owned slot is back
            assert tx.pools.recurrent[0].dtype == torch.float32
            assert tx.slots.num_free == tx.slots.num_slots
    finally:
        for ep in (*txs, *rxs):
            ep.close()


def _schema(cfg):
    return build_schema(cfg, 0, make_pools(cfg, 0))


def _peer(schema, role):
    from transfer.schema import SCHEMA_VERSION, PeerInfo  # noqa: PLC0415

    return PeerInfo(SCHEMA_VERSION, "nixl", f"{role}.a", "a", role, role, schema, b"")


def test_handshake_accepts_only_float32_to_bfloat16():
    model = tiny_model()
    f32, bf16 = _schema(engine_cfg(model, 1)), _schema(_bf16_state(engine_cfg(model, 1)))
    check_peer(_peer(f32, "sender"), _peer(bf16, "receiver"))  # either end runs the check
    check_peer(_peer(bf16, "receiver"), _peer(f32, "sender"))
    assert {p.cast for p in pair_templates(f32, bf16) if p.kind == "gdn_recurrent"} == {"bfloat16"}
    assert {p.cast for p in pair_templates(f32, f32)} == {""}
    for local, remote in (
        (_peer(bf16, "sender"), _peer(f32, "receiver")),
        (_peer(f32, "receiver"), _peer(bf16, "sender")),
    ):
        with pytest.raises(HandshakeError, match="cannot give back float32 bits") as e:
            check_peer(local, remote)
        assert e.value.field == "recurrent_dtype"


def test_requests_share_the_staging_slots_in_turn():
    """One staging slot, three requests in flight on source slots past it: each waits for the
    slot, casts into it once the one before is over, and every destination slot holds its own
    request's cast state; the staging slot is free at the end."""
    model = tiny_model()
    tc = TransferConfig(backend="nixl", checksum=True, staging_slots=1)
    sc, dc = engine_cfg(model, 1), _bf16_state(engine_cfg(model, 1))
    tx, rx = Sender(sc, 0, make_pools(sc, 0), "P", tc), Receiver(dc, 0, make_pools(dc, 0), "D", tc)
    try:
        tx.add_peer(rx.metadata())
        rx.add_peer(tx.metadata())
        tx.slots.allocate()  # the requests' source slots are 1, 2, 3: none is the staging slot's index
        reqs = []
        for n in range(3):
            state = global_state(model, TOKENS, 4, 30 + n)
            blocks, slot = tx.blocks.allocate(-(-TOKENS // 4)), tx.slots.allocate()
            place(tx.pools, sc, 0, state, blocks, slot)
            r = rx.reserve(f"q{n}", TOKENS)
            s = tx.send(f"q{n}", rx.target([r.target], f"q{n}", TOKENS), blocks, slot, TOKENS, owned=True)
            reqs.append((state, r, s))
        waited, deadline = False, time.monotonic() + 10
        while not all(s.quiet and r.state.terminal for _, r, s in reqs):
            assert time.monotonic() < deadline, "timed out"
            tx.poll()
            rx.poll()
            assert sum(s.stage_slot is not None and not s.quiet for _, _, s in reqs) <= 1
            waited |= any(s.queued and s.stage_slot is None and s.channels[0].granted for _, _, s in reqs)
        assert waited  # a granted request waited for the slot
        for state, r, s in reqs:
            assert (s.state.value, r.state.value) == ("done", "done"), (s.error, r.error)
            for layer, rec in state["rec"].items():
                got = rx.pools.recurrent[layer][r.slot]
                assert torch.equal(got.view(torch.int16), rec.to(torch.bfloat16).view(torch.int16)), layer
        assert tx.staging.free_slots == [0]
    finally:
        tx.close()
        rx.close()


def test_digests_pair_a_float32_prefill_node_with_a_bfloat16_decode_node_only():
    """The schema digest nodes are matched by (the router, a Prefill call's target, Sender.open)
    lets a float32 state feed a bfloat16 one and nothing else; the router's copy of the rule
    (it imports no torch) agrees with the transfer's."""
    from router.state_digest import feeds as router_feeds  # noqa: PLC0415
    from transfer.schema import feeds, model_digest  # noqa: PLC0415

    f32 = engine_cfg(tiny_model(), 1)
    fps = {
        "f32": model_digest(f32).fingerprint(),
        "bf16": model_digest(_bf16_state(f32)).fingerprint(),
        "f32-model": model_digest(engine_cfg(tiny_model(dtype=torch.float32), 1)).fingerprint(),
        "f32-model-bf16": model_digest(_bf16_state(engine_cfg(tiny_model(dtype=torch.float32), 1))).fingerprint(),
    }
    allowed = {(a, a) for a in fps} | {("f32", "bf16"), ("f32-model", "f32-model-bf16")}
    for a, fa in fps.items():
        for b, fb in fps.items():
            assert feeds(fa, fb) == ((a, b) in allowed) == router_feeds(fa, fb), (a, b)
