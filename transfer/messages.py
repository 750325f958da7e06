"""Control messages between a sender rank and a receiver rank (Begin, Grant, Refuse, Done, Release,
Abort, Renew) and the reservation target, each carrying the request id and the reservation's
incarnation so a late message never matches a newer reservation. Protocol: docs/transfer.md,
"Module notes"; leases: docs/router.md, "Leases and admission"."""

from __future__ import annotations

import msgspec

MAGIC = b"PDX1"  # prefix of every control payload: foreign notifications are ignored


class TargetRank(msgspec.Struct, frozen=True):
    """One destination rank's reservation for one request."""

    agent: str
    rank: int
    blocks: list[int]
    slot: int
    incarnation: int


class Target(msgspec.Struct, frozen=True):
    """Where a request's state goes: every destination rank's reservation (what the router carries)."""

    request_id: str
    node: str
    tp_size: int
    digest: str  # ModelDigest.fingerprint() of the destination
    num_tokens: int
    ranks: list[TargetRank]
    cached_blocks: int = 0  # leading pages the destination already holds: not written (plan.skip_cached)


class Begin(msgspec.Struct, tag="begin", frozen=True):
    request_id: str
    incarnation: int
    src: str  # sender agent
    node: str
    rank: int
    tp_size: int
    num_tokens: int
    src_blocks: list[int]
    src_slot: int
    dst_blocks: list[int]
    dst_slot: int
    cached_blocks: int = 0  # pages before src_blocks / dst_blocks that the destination already holds
    # the request's position offset after its prompt (a prompt with images, docs/images.md): the
    # destination continues 3-D rotary positions from it without the images
    rope_delta: int = 0


class Grant(msgspec.Struct, tag="grant", frozen=True):
    request_id: str
    incarnation: int
    src: str  # receiver agent
    tag_base: int = 0  # UCXX: the data tags of this channel start here


class Refuse(msgspec.Struct, tag="refuse", frozen=True):
    request_id: str
    incarnation: int
    src: str
    reason: str


class Done(msgspec.Struct, tag="done", frozen=True):
    request_id: str
    incarnation: int
    src: str
    rank: int
    nbytes: int
    checksum: int | None = None


class Abort(msgspec.Struct, tag="abort", frozen=True):
    request_id: str
    incarnation: int
    src: str
    rank: int
    reason: str
    ended: bool = False  # the request ended (length, stop, or its caller cancelled it) before its push: no fault
    # the source had the destination's Grant, and a two-sided transport's receives posted for it are
    # completed (written or drained) before this Abort; False: it never had it, nothing will come
    granted: bool = True


class Release(msgspec.Struct, tag="release", frozen=True):
    request_id: str
    incarnation: int
    src: str
    reason: str
    asked: bool = False  # the receiver's caller asked for it (a cancel, an end seen first): not a fault


class Renew(msgspec.Struct, tag="renew", frozen=True):
    request_id: str
    incarnation: int
    src: str  # sender agent
    node: str  # sender node


Control = Begin | Grant | Refuse | Done | Abort | Release | Renew

_enc = msgspec.msgpack.Encoder()
_dec: msgspec.msgpack.Decoder[Control] = msgspec.msgpack.Decoder(Control)  # a union: name the type
_target_dec = msgspec.msgpack.Decoder(Target)


def encode_control(msg: Control) -> bytes:
    return MAGIC + _enc.encode(msg)


def decode_control(data: bytes) -> Control | None:
    """The message, or None for a payload that is not ours or does not decode."""
    if not data.startswith(MAGIC):
        return None
    try:
        return _dec.decode(data[len(MAGIC) :])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def encode_target(t: Target) -> bytes:
    return _enc.encode(t)


def decode_target(data: bytes) -> Target:
    return _target_dec.decode(data)
