"""Transfer endpoints inside an engine's tensor-parallel workers: the rank-side functions the
connector (transfer/connector/) runs on every rank through the executor. Each rank's Sender or
Receiver lives beside its pools; the engine owns the memory and frees it only once a poll says
no write can touch it. The call sequence: docs/transfer.md, "Module notes"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import msgspec

from engine.connector import LayerConnector
from transfer.config import TransferConfig
from transfer.messages import Target, TargetRank
from transfer.receiver import Receiver
from transfer.sender import Sender, SendRequest

if TYPE_CHECKING:
    from engine.devices import DeviceMark
    from engine.worker import Worker

GONE = "gone"  # the state of a request this rank no longer (or never) held


class SendStatus(msgspec.Struct, frozen=True):
    """One sender rank's view of one push."""

    state: str  # a TransferState value, or "gone": never opened here, or forgotten
    error: str | None = None
    quiet: bool = True  # no write can still read the source pages
    nbytes: int = 0  # bytes this rank wrote so far
    writes: int = 0  # WRITEs this rank posted so far (page, layer and final posts)
    asked: bool = False  # failed because a destination's caller asked (Release.asked): not a fault


class RecvStatus(msgspec.Struct, frozen=True):
    """One receiver rank's view of one reservation."""

    state: str  # a TransferState value, or "gone": taken, or failed and freed
    error: str | None = None  # why it failed (also remembered a while once gone)
    freed: bool = True  # no write can still land in its memory
    renewals: int = 0  # lease renewals counted so far
    expired: bool = False  # failed because its lease ran out
    ended: bool = False  # failed because a source's request ended on its own (Abort.ended)


_SENDS = "transfer.sends"  # request id -> SendRequest, until forgotten


def _sends(worker: Worker) -> dict[str, SendRequest]:
    """This rank's open pushes (in the worker's per-rank store)."""
    return cast(dict[str, SendRequest], worker.ext.setdefault(_SENDS, {}))


def _key(backend: str) -> str:
    return f"transfer.{backend}"


def endpoint(worker: Worker, backend: str) -> Sender | Receiver:
    ep = worker.ext.get(_key(backend))
    if not isinstance(ep, Sender | Receiver):
        raise RuntimeError(f"rank {worker.rank} has no {backend} transfer endpoint; call open_endpoint first")
    return ep


def _sender(worker: Worker, backend: str) -> Sender:
    ep = endpoint(worker, backend)
    if not isinstance(ep, Sender):
        raise RuntimeError(f"rank {worker.rank}'s {backend} endpoint is a receiver, not a sender")
    return ep


def _receiver(worker: Worker, backend: str) -> Receiver:
    ep = endpoint(worker, backend)
    if not isinstance(ep, Receiver):
        raise RuntimeError(f"rank {worker.rank}'s {backend} endpoint is a sender, not a receiver")
    return ep


# ---- both roles ------------------------------------------------------------------------------
def open_endpoint(worker: Worker, role: str, node: str, config: TransferConfig | None = None) -> bytes:
    """Create this rank's sender or receiver over its pools; returns its handshake blob."""
    config = config or TransferConfig()
    cls = {"sender": Sender, "receiver": Receiver}.get(role)
    if cls is None:
        raise ValueError(f"unknown transfer role {role!r}; known: sender, receiver")
    ep = cls(worker.cfg, worker.rank, worker.pools, node=node, config=config, fence=worker.fence)
    worker.ext[_key(config.backend)] = ep
    if role == "sender":
        worker.use_layer_connector(LayerPosts(worker))
    return ep.metadata()


def metadata(worker: Worker, backend: str) -> bytes:
    return endpoint(worker, backend).metadata()


def digest(worker: Worker, backend: str) -> str:
    return endpoint(worker, backend).digest


def add_peers(worker: Worker, backend: str, blobs: list[bytes]) -> list[str]:
    """Handshake with every rank of a peer node (raises HandshakeError naming the field)."""
    ep = endpoint(worker, backend)
    return [ep.add_peer(b) for b in blobs]


def remove_peer(worker: Worker, backend: str, agent: str, reason: str = "declared dead") -> None:
    endpoint(worker, backend).remove_peer(agent, reason)


def drop_node(worker: Worker, backend: str, node: str, reason: str = "declared dead by the router") -> list[str]:
    """Remove every agent of a peer node: its requests here fail (and free once safe)."""
    ep = endpoint(worker, backend)
    gone = [a for a, p in list(ep.peers.items()) if p.info.node == node]
    for a in gone:
        ep.remove_peer(a, reason)
    return gone


def close(worker: Worker, backend: str) -> None:
    ep = worker.ext.pop(_key(backend), None)
    worker.ext.pop(_SENDS, None)
    if isinstance(ep, Sender):
        worker.use_layer_connector(None)
    if isinstance(ep, Sender | Receiver):
        ep.close()


def make_target(
    ranks: list[TargetRank], node: str, request_id: str, prompt_len: int, tp: int, digest: str, cached_blocks: int = 0
) -> Target:
    return Target(request_id, node, tp, digest, prompt_len, sorted(ranks, key=lambda t: t.rank), cached_blocks)


# ---- sender (prefill) --------------------------------------------------------------------------
def open_send(
    worker: Worker,
    backend: str,
    rid: str,
    target: Target,
    blocks: list[int],
    slot: int,
    num_tokens: int,
    rope_delta: int = 0,
) -> None:
    """Begin to the destination ranks now; the writes follow with `post` once the state exists.
    The memory stays the engine's (release the HELD request once every rank is quiet)."""
    req = _sender(worker, backend).open(rid, target, blocks, slot, num_tokens, owned=False, rope_delta=rope_delta)
    _sends(worker)[rid] = req


def send(
    worker: Worker,
    backend: str,
    rid: str,
    target: Target,
    blocks: list[int],
    slot: int,
    num_tokens: int,
    rope_delta: int = 0,
) -> None:
    """Open and post at once (the state already exists)."""
    req = _sender(worker, backend).send(rid, target, blocks, slot, num_tokens, owned=False, rope_delta=rope_delta)
    _sends(worker)[rid] = req


def post(worker: Worker, backend: str, rid: str) -> None:
    """Write everything and Done: at once when the grants are in (polled first), else when they come."""
    _sender(worker, backend).poll()
    _sends(worker)[rid].post()


def post_pages(worker: Worker, backend: str, rid: str, num_pages: int) -> None:
    """Write the KV of the prompt's first `num_pages` pages not yet written (a prefill chunk finished)."""
    ep = _sender(worker, backend)
    ep.poll()
    _sends(worker)[rid].post_pages(num_pages)


class LayerPosts(LayerConnector):
    """A sender rank's worker side: as the forward finishes a layer of a request's last prompt
    chunk, the layer's pages not yet written and its GDN state go out (behind the layer's device
    event on a GPU), so little is left to write once the first token exists. A post that fails
    fails its push only, never the step."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def layer_done(self, request_ids: Sequence[str], layer: int, mark: DeviceMark | None) -> None:
        sends = _sends(self.worker)
        for rid in request_ids:
            req = sends.get(rid)
            if req is None:
                continue
            try:
                req.post(layers=(layer,), final=False, ready=mark)
            except Exception as e:  # noqa: BLE001 (the step goes on; the connector's poll sees the failure)
                req.abort(f"posting layer {layer} failed: {e}")


def renew(worker: Worker, backend: str, targets: list[Target]) -> int:
    """Restart the lease of each target's reservation on the destination ranks this rank writes."""
    ep = _sender(worker, backend)
    return sum(ep.renew(t) for t in targets)


def withdraw(worker: Worker, backend: str, target: Target, reason: str) -> int:
    """Tell the destination ranks this rank writes that the request ended before its push
    (Abort, never granted): its reservation is freed now. Returns the ranks told."""
    return _sender(worker, backend).withdraw(target, reason)


def poll_sends(worker: Worker, backend: str, rids: list[str]) -> list[SendStatus]:
    """Drive the endpoint once; one SendStatus per request id."""
    _sender(worker, backend).poll()
    store = _sends(worker)
    out = []
    for rid in rids:
        r = store.get(rid)
        out.append(
            SendStatus(GONE) if r is None else SendStatus(r.state.value, r.error, r.quiet, r.nbytes, r.writes, r.asked)
        )
    return out


def abort_send(worker: Worker, backend: str, rid: str, reason: str, ended: bool = False) -> None:
    r = _sends(worker).get(rid)
    if r is not None:
        r.abort(reason, ended)


def forget_send(worker: Worker, backend: str, rid: str) -> None:
    _sends(worker).pop(rid, None)


# ---- receiver (decode) -------------------------------------------------------------------------
def _no_free(blocks: list[int], slot: int) -> None:
    """The engine's scheduler frees an adopted reservation (EngineCore.release), not the endpoint."""


def adopt(
    worker: Worker,
    backend: str,
    rid: str,
    prompt_len: int,
    blocks: list[int],
    slot: int,
    lease_s: float | None,
    inc: int,
    cached_blocks: int = 0,
) -> TargetRank:
    """Take the engine's reservation under a lease (None: the endpoint's TransferConfig.lease_s);
    its first `cached_blocks` pages already hold the prompt's KV and are not written. Returns
    this rank's target."""
    req = _receiver(worker, backend).adopt(
        rid, prompt_len, blocks, slot, lease_s=lease_s, incarnation=inc, free=_no_free, cached_blocks=cached_blocks
    )
    return req.target


def poll_reservations(worker: Worker, backend: str, keys: list[tuple[str, int]]) -> list[RecvStatus]:
    """Drive the endpoint once; one RecvStatus per (request id, incarnation)."""
    ep = _receiver(worker, backend)
    ep.poll()
    out = []
    for key in keys:
        r = ep.requests.get(key)
        if r is None:  # ended (taken, or failed and freed): say why it failed, if it did
            out.append(RecvStatus(GONE, ep.recent.get(key), True, 0, key in ep.recent_expired, key in ep.recent_ended))
        else:
            out.append(RecvStatus(r.state.value, r.error, r.freed, r.renewals, r.expired, r.ended))
    return out


def abort_reservation(worker: Worker, backend: str, rid: str, inc: int, reason: str, asked: bool = False) -> None:
    """Fail (or, when done, release) a reservation; its memory is freed once no write can land.
    asked: the router asked for it (a cancel), which the sources are told (Release.asked)."""
    r = _receiver(worker, backend).requests.get((rid, inc))
    if r is not None:
        r.abort(reason, asked)


def take(worker: Worker, backend: str, rid: str, inc: int) -> int | None:
    """A DONE reservation's memory goes to the engine's request (now decoding); returns the
    rope_delta its sources' Begins carried (None: this rank had no source)."""
    req = _receiver(worker, backend).requests[(rid, inc)]
    req.take()
    return req.rope_delta
