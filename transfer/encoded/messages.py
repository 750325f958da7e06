"""Typed records of the encoder-output transfer (state kind `encoder_output`): where a prefill
node lets encode nodes write (`LandingTarget`, one `LandingSlot` per image, answered to the
router's ReserveEncoded and carried to the encode node), and what an encode node says it wrote
(`EncodedOutput`, the notification that follows the WRITE: per tensor its name, dtype, shape,
axes, byte offset and length, plus the producer's TP place). The receiver checks every field
against its slot and its own model before it uses a byte (fail closed)."""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from typing import Literal

import msgspec

from engine.vision.config import VisionConfig

ENCODED_VERSION = 1  # 1: embeddings (+ deepstack outputs, none for Qwen3.5), replicated on every rank
MAGIC = b"PDE1"  # prefix of an EncodedOutput notification: anything else on the agent is ignored

Kind = Literal["encoder_output"]


def vision_digest(vision: VisionConfig, dtype: str) -> str:
    """The vision tower's sizes and dtype: what both sides must agree on (they load the same
    checkpoint, as prefill and decode nodes do)."""
    raw = msgspec.msgpack.encode({"vision": asdict(vision), "dtype": dtype, "version": ENCODED_VERSION})
    return hashlib.sha256(raw).hexdigest()[:16]


class LandingSlot(msgspec.Struct, frozen=True):
    """Room for one image's encoder output in the landing region."""

    pixel_hash: bytes
    offset: int  # bytes from the region's base
    nbytes: int  # what the slot holds: every tensor of the image, back to back


class LandingTarget(msgspec.Struct, frozen=True):
    """A prefill node's answer to ReserveEncoded: its landing agent (name, NIXL metadata, region
    base address) and a slot per image it wants; what the encode node must match."""

    version: int
    node: str
    agent: str
    metadata: bytes  # the landing agent's NIXL metadata
    incarnation: int  # of the landing: a slot of an older one is never written
    base_addr: int
    region_bytes: int
    digest: str  # vision_digest of the prefill node
    dtype: str  # the model's dtype: the embeddings travel in it
    hidden: int  # out_hidden_size: columns of the embeddings
    tp_size: int  # the prefill node's ranks: each gets the whole output (replicated)
    lease_s: float
    slots: list[LandingSlot]


class EncodedTensor(msgspec.Struct, frozen=True):
    name: str  # "embeddings" | "deepstack.<i>"
    dtype: str
    shape: list[int]
    axes: list[str]  # ["token", "hidden"]
    offset: int  # bytes from the region's base
    nbytes: int


class EncodedOutput(msgspec.Struct, frozen=True):
    """What an encode node wrote into a slot (sent as a notification once the bytes landed)."""

    version: int
    kind: Kind
    incarnation: int  # the landing's, from the LandingTarget
    src: str  # the encode node
    pixel_hash: bytes
    grid_thw: list[int]
    digest: str  # vision_digest of the encode node
    tp_size: int  # encoder ranks that produced it (each computes the whole output)
    tp_rank: int
    replicated: bool  # every destination rank takes the whole tensors
    tensors: list[EncodedTensor]
    crc32: int  # of the slot's bytes, checked by the receiver


_enc = msgspec.msgpack.Encoder()
_out_dec = msgspec.msgpack.Decoder(EncodedOutput)
_target_dec = msgspec.msgpack.Decoder(LandingTarget)


def encode_output(msg: EncodedOutput) -> bytes:
    return MAGIC + _enc.encode(msg)


def decode_output(data: bytes) -> EncodedOutput | None:
    """The record, or None for a payload that is not one or does not decode."""
    if not data.startswith(MAGIC):
        return None
    try:
        return _out_dec.decode(data[len(MAGIC) :])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def encode_target(t: LandingTarget) -> bytes:
    return _enc.encode(t)


def decode_target(data: bytes) -> LandingTarget:
    """msgspec.DecodeError / ValidationError on a malformed target."""
    return _target_dec.decode(data)
