"""The encoder-output state kind over real NIXL agents (two in one process, loopback): a pushed
output lands in its slot and comes back bit-exact with its typed record; the record's round trip;
a wrong dtype, digest or incarnation is refused before a byte is used; slots are freed on take,
on release and when their lease ends."""

from __future__ import annotations

import msgspec
import pytest
import torch

from transfer.encoded.landing import Landing
from transfer.encoded.messages import (
    EncodedOutput,
    EncodedTensor,
    LandingTarget,
    decode_output,
    decode_target,
    encode_output,
    encode_target,
)
from transfer.encoded.pusher import Pusher, PushError

HIDDEN = 32


@pytest.fixture
def pair():
    land = Landing("prefill-t", 1 << 20, "digest-a", torch.float32, HIDDEN, tp_size=2)
    push = Pusher("encode-t", 1 << 20, "digest-a")
    yield land, push
    push.close()
    land.close()


def test_records_round_trip():
    rec = EncodedOutput(
        1,
        "encoder_output",
        7,
        "encode-0",
        b"h" * 32,
        [1, 4, 6],
        "d",
        1,
        0,
        True,
        [EncodedTensor("embeddings", "float32", [6, HIDDEN], ["token", "hidden"], 64, 768)],
        5,
    )
    assert decode_output(encode_output(rec)) == rec
    assert decode_output(b"PDX1junk") is None
    t = LandingTarget(1, "p", "a", b"m", 3, 4096, 1 << 20, "d", "float32", HIDDEN, 1, 5.0, [])
    assert decode_target(encode_target(t)) == t
    with pytest.raises(msgspec.ValidationError):
        decode_target(msgspec.msgpack.encode({"version": "x"}))


def test_push_lands_exact_and_frees_the_slot(pair):
    land, push = pair
    a, b = torch.randn(6, HIDDEN), torch.randn(10, HIDDEN)
    target = land.reserve([(b"a" * 32, 6), (b"b" * 32, 10)], lease_s=30)
    assert [s.nbytes for s in target.slots] == [6 * HIDDEN * 4, 10 * HIDDEN * 4] and land.pending() == 2
    assert target.slots[1].offset % 64 == 0 and target.slots[1].offset >= target.slots[0].nbytes
    for slot, t in zip(target.slots, (a, b)):
        push.check(target, torch.float32, HIDDEN)
        assert push.push(target, slot, [1, 4, 6], t, timeout_s=10) == t.numel() * 4
    got_b = land.take(b"b" * 32, wait_s=5)
    got_a = land.take(b"a" * 32, wait_s=5)
    assert got_a is not None and got_b is not None
    assert torch.equal(got_a.embeddings, a) and torch.equal(got_b.embeddings, b) and got_a.src == "encode-t"
    assert land.pending() == 0
    assert land.take(b"a" * 32, wait_s=0) is None  # taken once


def test_refusals_and_leases(pair):
    land, push = pair
    target = land.reserve([(b"c" * 32, 4)], lease_s=30)
    with pytest.raises(PushError, match="takes float32"):
        push.check(target, torch.bfloat16, HIDDEN)
    other = Pusher("encode-u", 1 << 16, "digest-b")
    try:
        with pytest.raises(PushError, match="vision digest"):
            other.check(target, torch.float32, HIDDEN)
        other.push(target, target.slots[0], [1, 4, 4], torch.randn(4, HIDDEN), timeout_s=10)  # unchecked: lands
    finally:
        other.close()
    assert land.take(b"c" * 32, wait_s=2) is None  # its record named another digest: dropped
    assert land.dropped == 1 and land.pending() == 0
    # a wrong shape for the slot is refused by the sender
    target = land.reserve([(b"d" * 32, 4)], lease_s=30)
    with pytest.raises(PushError, match="does not fit"):
        push.push(target, target.slots[0], [1, 4, 4], torch.randn(8, HIDDEN), timeout_s=10)
    land.release([b"d" * 32])
    assert land.pending() == 0
    # a lease ends: the room is given again; a region too small for a slot gives none
    land.reserve([(b"e" * 32, 4)], lease_s=0.0)
    assert land.reserve([(b"f" * 32, 4)], lease_s=30).slots[0].offset == 0
    assert land.reserve([(b"g" * 32, 1 << 20)], lease_s=30).slots == []
