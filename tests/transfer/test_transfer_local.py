"""Two real endpoints in one process (loopback): protocol paths that need no second process,
and the registry. The multi-process acceptance tests are in test_transfer_e2e.py."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from tests.helpers.xfer_state import (
    engine_cfg,
    global_state,
    make_pools,
    mismatches,
    noise,
    place,
    snapshot,
    tiny_model,
)
from transfer import HandshakeError, Receiver, Sender, TransferConfig, TransferError, get_transport, plan
from transfer.backend import WriteJob
from transfer.nixl_backend import _rows, job_indices
from transfer.plan import pair_templates

pytestmark = pytest.mark.timeout(120)
TOKENS = 15


def _pair(backend="nixl", model=None, a=1, b=1, **cfg):
    model = model or tiny_model()
    tc = TransferConfig(backend=backend, checksum=True, **cfg)
    sc, dc = engine_cfg(model, a), engine_cfg(model, b)
    sp, dp = make_pools(sc, 0), make_pools(dc, 0)
    noise(sp, 1)
    noise(dp, 2)
    tx, rx = Sender(sc, 0, sp, "P", tc), Receiver(dc, 0, dp, "D", tc)
    tx.add_peer(rx.metadata())
    rx.add_peer(tx.metadata())
    return model, sc, dc, tx, rx


def _fill(tx, cfg, model, seed=5):
    blocks = tx.blocks.allocate(-(-TOKENS // 4))
    slot = tx.slots.allocate()
    place(tx.pools, cfg, 0, global_state(model, TOKENS, 4, seed), blocks, slot)
    return blocks, slot


def _opened(tx, rx, sc, model):
    """(the destination's pools before, source blocks, reservation, request): a request "q" of
    TOKENS filled on the source, opened and granted, nothing written yet."""
    before = snapshot(rx.pools)
    blocks, slot = _fill(tx, sc, model)
    r = rx.reserve("q", TOKENS)
    s = tx.open("q", rx.target([r.target], "q", TOKENS), blocks, slot, TOKENS, owned=True)
    _drive(tx, rx, until=lambda: all(ch.granted for ch in s.channels.values()))
    return before, blocks, r, s


def _landed(tx, rx, s, r, model, dc, before, blocks):
    """Drive a posted request to its end: done on both sides, the destination's pools bit-exact
    (the request's state in its pages and slot, every other byte as `before`)."""
    _drive(tx, rx, until=lambda: s.state.terminal and s.quiet and r.state.terminal)
    assert (s.state.value, r.state.value) == ("done", "done"), (s.error, r.error)
    exp = make_pools(dc, 0)
    for kind, layer, t in exp.tensors():
        t.copy_(before[(kind, layer)])
    place(exp, dc, 0, global_state(model, TOKENS, 4, 5), r.blocks[: len(blocks)], r.slot)
    assert mismatches(rx.pools, snapshot(exp)) == []


def _drive(*eps, until, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out"
        for ep in eps:
            ep.poll()


def test_unknown_backend_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown transfer backend 'tcp'; known backends: nixl, ucxx"):
        TransferConfig(backend="tcp")
    with pytest.raises(ValueError, match="known backends: nixl, ucxx"):
        get_transport("rdma")


@pytest.mark.parametrize("backend", ["nixl", "ucxx"])
def test_two_endpoints_in_one_process(backend):
    model, sc, dc, tx, rx = _pair(backend)
    try:
        before = snapshot(rx.pools)
        blocks, slot = _fill(tx, sc, model)
        r = rx.reserve("q", TOKENS)
        s = tx.send("q", rx.target([r.target], "q", TOKENS), blocks, slot, TOKENS, owned=True)
        _landed(tx, rx, s, r, model, dc, before, blocks)
        assert r.take() == (r.blocks, r.slot)
        assert tx.blocks.num_free == tx.blocks.num_blocks and tx.slots.num_free == tx.slots.num_slots
    finally:
        tx.close()
        rx.close()


def test_checksum_mismatch_fails_and_frees():
    model, sc, dc, tx, rx = _pair()
    try:
        blocks, slot = _fill(tx, sc, model)
        free0 = (rx.blocks.num_blocks, rx.slots.num_free)
        r = rx.reserve("q", TOKENS)
        s = tx.send("q", rx.target([r.target], "q", TOKENS), blocks, slot, TOKENS)
        _drive(tx, rx, until=lambda: s.state.value != "pending")  # granted and posted
        _drive(tx, until=lambda: s.state.terminal)  # landed, Done sent; the receiver has not looked yet
        rx.pools.recurrent[0][r.slot].view(-1)[3] += 1.0  # a byte flips after landing
        _drive(rx, until=lambda: r.state.terminal and r.freed)
        assert r.state.value == "failed" and "checksum mismatch from source rank 0" in r.error
        assert (rx.blocks.num_free, rx.slots.num_free) == free0
    finally:
        tx.close()
        rx.close()


def test_ids_that_are_not_the_reservation_are_refused():
    model, sc, dc, tx, rx = _pair()
    try:
        blocks, slot = _fill(tx, sc, model)
        r = rx.reserve("q", TOKENS)
        t = rx.target([r.target], "q", TOKENS)
        forged = msgspec.structs.replace(
            t, ranks=[msgspec.structs.replace(t.ranks[0], blocks=[b + 1 for b in r.blocks])]
        )
        s = tx.send("q", forged, blocks, slot, TOKENS)
        _drive(tx, rx, until=lambda: s.state.terminal and r.state.terminal and r.freed)
        assert "refused" in s.error and "not this reservation's" in s.error
        assert r.state.value == "failed" and "refused source rank 0" in r.error
    finally:
        tx.close()
        rx.close()


def test_target_for_another_model_is_refused():
    model, sc, dc, tx, rx = _pair()
    try:
        blocks, slot = _fill(tx, sc, model)
        r = rx.reserve("q", TOKENS)
        t = msgspec.structs.replace(rx.target([r.target], "q", TOKENS), digest="0" * 16)
        with pytest.raises(TransferError, match="model digest"):
            tx.send("q", t, blocks, slot, TOKENS)
    finally:
        tx.close()
        rx.close()


def test_incompatible_peer_is_refused_at_add_peer():
    a = tiny_model(hv=8)
    b = tiny_model(hv=4)
    tx = Sender(engine_cfg(a, 1), 0, make_pools(engine_cfg(a, 1), 0), "P")
    rx = Receiver(engine_cfg(b, 1), 0, make_pools(engine_cfg(b, 1), 0), "D")
    try:
        with pytest.raises(HandshakeError, match="linear_num_value_heads differs \\(local 8, remote 4\\)"):
            tx.add_peer(rx.metadata())
        assert not tx.peers
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("backend", ["nixl", "ucxx"])
def test_grant_timeout_then_late_begin_is_settled(backend):
    model, sc, dc, tx, rx = _pair(backend, grant_timeout_s=0.2)
    try:
        blocks, slot = _fill(tx, sc, model)
        free0 = (rx.blocks.num_free, rx.slots.num_free)
        r = rx.reserve("q", TOKENS)
        s = tx.send("q", rx.target([r.target], "q", TOKENS), blocks, slot, TOKENS, owned=True)
        _drive(tx, until=lambda: s.state.terminal)  # the receiver does not poll: no grant
        assert s.state.value == "failed" and "no grant from destination ranks [0]" in s.error
        assert s.quiet and tx.blocks.num_free == tx.blocks.num_blocks
        # the late Begin is granted (receives posted, on a two-sided transport), then the sender's Abort:
        # the sender never had the Grant, so nothing comes for those receives and the memory is back
        _drive(tx, rx, until=lambda: r.state.terminal and r.freed, timeout=5.0)
        assert "source rank 0 aborted" in r.error
        assert (rx.blocks.num_free, rx.slots.num_free) == free0
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("backend", ["nixl", "ucxx"])
def test_a_cancel_crossing_the_grant_frees_the_reservation(backend, caplog):
    """The caller cancels the push after the sender sent its Begin and before the receiver's Grant
    reached it (a client that disconnects at its first token): the receiver grants, then reads the
    Abort. Nothing was or will be written: the reservation's memory is back at once, and the sender
    took the Grant (it settles after it: a two-sided transport's posted receives are drained, not
    left behind)."""
    caplog.set_level("INFO", logger="transfer")
    model, sc, dc, tx, rx = _pair(backend)
    try:
        blocks, slot = _fill(tx, sc, model)
        free0 = (rx.blocks.num_free, rx.slots.num_free)
        r = rx.reserve("q", TOKENS)
        s = tx.send("q", rx.target([r.target], "q", TOKENS), blocks, slot, TOKENS, owned=True)
        s.abort("cancelled by the caller", ended=True)  # before any poll: the Grant is not back
        _drive(tx, rx, until=lambda: s.quiet and r.state.terminal and r.freed, timeout=5.0)
        assert r.state.value == "failed" and "source rank 0 aborted" in r.error
        assert (rx.blocks.num_free, rx.slots.num_free) == free0
        assert tx.blocks.num_free == tx.blocks.num_blocks
        assert not [m for m in caplog.messages if "no such channel" in m], caplog.messages
    finally:
        tx.close()
        rx.close()


def test_peer_restart_replaces_the_old_incarnation():
    model, sc, dc, tx, rx = _pair()
    tx2 = Sender(sc, 0, make_pools(sc, 0), "P", TransferConfig(checksum=True))
    try:
        blocks, slot = _fill(tx, sc, model)
        r = rx.reserve("q", TOKENS)
        tx.open("q", rx.target([r.target], "q", TOKENS), blocks, slot, TOKENS)
        _drive(tx, rx, until=lambda: r.state.value == "transferring")
        rx.add_peer(tx2.metadata())  # same node and rank, new incarnation: the old agent is dropped
        assert tx.agent not in rx.peers and tx2.agent in rx.peers
        assert r.state.value == "failed" and f"source agent {tx.agent} removed (replaced by incarnation" in r.error
        assert r.freed
    finally:
        for ep in (tx, tx2, rx):
            ep.close()


@pytest.mark.parametrize("a,b,kvh", [(1, 1, 2), (2, 1, 1), (1, 4, 2), (4, 2, 1)])
def test_nixl_descriptors_merge_into_exactly_the_plan(a, b, kvh):
    """The NIXL index lists, merged the way NIXL merges adjacent descriptors, are the plan."""
    model = tiny_model(kvh=kvh)
    sc, dc = engine_cfg(model, a), engine_cfg(model, b)
    from transfer.schema import build_schema  # noqa: PLC0415

    src = build_schema(sc, a - 1, make_pools(sc, a - 1))
    dst = build_schema(dc, b - 1, make_pools(dc, b - 1))
    pairs = pair_templates(src, dst)
    lrows, lbase = _rows(pairs, "src")
    rrows, rbase = _rows(pairs, "dst")
    sb, db = [7, 8, 9, 3], [2, 3, 4, 5]
    job = WriteJob(list(enumerate(pairs)), sb, db, 1, 2, None)
    li, ri = job_indices(list(enumerate(pairs)), lbase, rbase, job)
    merged = []
    for (la, ln, _), (ra, _, _) in zip(lrows[li].tolist(), rrows[ri].tolist()):
        if merged and merged[-1][0] + merged[-1][2] == la and merged[-1][1] + merged[-1][2] == ra:
            merged[-1][2] += ln
        else:
            merged.append([la, ra, ln])
    bases = {(t.layer, t.kind): (t.base_addr, None) for t in src.tensors}
    dbase = {(t.layer, t.kind): t.base_addr for t in dst.tensors}
    expected = [
        [bases[(r.layer, r.kind)][0] + r.src_off, dbase[(r.layer, r.kind)] + r.dst_off, r.length]
        for r in plan(src, dst, sb, db, 1, 2)
    ]
    assert merged == expected
    assert np.all(lrows[li][:, 1] == rrows[ri][:, 1])


@pytest.mark.parametrize("backend", ["nixl", "ucxx"])
def test_streamed_in_parts_after_a_long_prefill(backend):
    """Grants are taken at open; KV goes first, the GDN state last (after a prefill longer than
    the grant timeout); the destination completes only on the final part, bit-exact."""
    model, sc, dc, tx, rx = _pair(backend, grant_timeout_s=0.2)
    try:
        before, blocks, r, s = _opened(tx, rx, sc, model)
        deadline = time.monotonic() + 0.4
        _drive(tx, rx, until=lambda: time.monotonic() > deadline)  # "prefill" outlives the grant timeout
        assert s.state.value == "pending" and r.state.value == "transferring"
        s.post(layers=model.attention_layers, final=False)
        _drive(tx, rx, until=lambda: not any(ch.xfers for ch in s.channels.values()))
        assert r.state.value == "transferring"  # KV landed, no Done yet
        s.post()  # the GDN state and Done
        _landed(tx, rx, s, r, model, dc, before, blocks)
        r.release()
        assert rx.blocks.num_free == rx.blocks.num_blocks and rx.slots.num_free == rx.slots.num_slots
        assert tx.blocks.num_free == tx.blocks.num_blocks and tx.slots.num_free == tx.slots.num_slots
    finally:
        tx.close()
        rx.close()


class _Mark:
    """A device event the test completes by hand (what StepFence.mark records on a GPU)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_layer_posts_wait_for_their_layers_device_event_without_blocking():
    """A layer posted inside a step goes out once the device passed the event recorded after its
    kernels; the posts behind it keep their order; the destination is bit-exact at the end."""
    model, sc, dc, tx, rx = _pair()
    try:
        before, blocks, r, s = _opened(tx, rx, sc, model)
        first, second = _Mark(), _Mark()
        second.done = True  # the later layer's event is done; it still waits behind the first
        s.post(layers=[0], final=False, ready=first)
        s.post(layers=[1], final=False, ready=second)
        tx.poll()
        assert s.writes == 0 and len(s.queued) == 2 and s.state.value == "pending"
        first.done = True
        tx.poll()  # the next poll posts both, in order
        assert s.writes == 2 and not s.queued
        assert [sorted(ch.sent) for ch in s.channels.values()] == [
            [i for i, p in enumerate(ch.peer.pairs) if p.layer in (0, 1)] for ch in s.channels.values()
        ]
        s.post()  # the other layers and Done
        _landed(tx, rx, s, r, model, dc, before, blocks)
        r.release()
    finally:
        tx.close()
        rx.close()


def test_adopted_reservation_is_freed_through_the_callers_callback():
    """Memory the engine allocated is reserved with adopt(); on failure the transfer layer hands
    it back through the callback, once, when no write can land."""
    model, sc, dc, tx, rx = _pair()
    try:
        freed = []
        blocks = rx.blocks.allocate(rx.blocks.blocks_for(TOKENS + 1))
        slot = rx.slots.allocate()
        r = rx.adopt("q", TOKENS, blocks, slot, lease_s=0.2, free=lambda b, s: freed.append((b, s)))
        _drive(rx, until=lambda: r.freed)
        assert r.state.value == "failed" and r.error == "lease expired (no source began)"
        assert freed == [(blocks, slot)]
        rx.blocks.free(blocks)
        rx.slots.free(slot)
    finally:
        tx.close()
        rx.close()


def test_renew_keeps_a_reservation_past_its_lease_and_silence_expires_it():
    """A source's Renew restarts the lease (the request is queued or computes there): the
    reservation outlives several leases while renewed, the data still lands, and a reservation
    nobody renews fails at its lease, flagged as expired, its memory back at once."""
    model, sc, dc, tx, rx = _pair()
    try:
        r = rx.reserve("q", TOKENS, lease_s=0.3)
        idle = rx.reserve("idle", TOKENS, lease_s=0.3)
        target = rx.target([r.target], "q", TOKENS)
        other = rx.target([rx.target([idle.target], "idle", TOKENS).ranks[0]], "idle", TOKENS)
        end = time.monotonic() + 1.2  # four leases
        while time.monotonic() < end:
            assert tx.renew(target) == 1
            for _ in range(5):
                tx.poll()
                rx.poll()
                time.sleep(0.01)
        assert idle.state.value == "failed" and idle.expired and idle.freed
        assert idle.error == "lease expired (no source began)"
        assert r.state.value == "pending" and not r.expired and r.renewals >= 10
        assert tx.renew(other) == 1  # a Renew for an ended reservation is ignored, not an error
        _drive(tx, rx, until=lambda: any("Renew for idle" in s for s in rx.stale))
        blocks = tx.blocks.allocate(tx.blocks.blocks_for(TOKENS))
        slot = tx.slots.allocate()
        s = tx.send("q", target, blocks, slot, TOKENS, owned=True)
        _drive(tx, rx, until=lambda: r.state.value == "done" and s.quiet)
        r.release()
        assert rx.blocks.num_free == rx.blocks.num_blocks and rx.slots.num_free == rx.slots.num_slots
    finally:
        tx.close()
        rx.close()
