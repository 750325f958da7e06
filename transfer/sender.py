"""The prefill side of one rank: writes a request's state from this rank's pools into the
destination's (Begin, Grant, writes, Done), with the phases PENDING -> TRANSFERRING -> DONE or
FAILED. Lifecycle: docs/transfer.md, "Module notes"."""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from transfer.backend import TransferState, WriteJob, host_bytes
from transfer.endpoint import Endpoint, Peer
from transfer.errors import PlanError, TransferError
from transfer.messages import (
    Abort,
    Begin,
    Control,
    Done,
    Grant,
    Refuse,
    Release,
    Renew,
    Target,
    TargetRank,
    encode_control,
)
from transfer.plan import RegionPair, check_ids, expand_arrays, pair_templates, plan_nbytes, skip_cached, src_key
from transfer.schema import PeerInfo, feeds
from transfer.staging import Staging, casts_in

if TYPE_CHECKING:
    from engine.devices import DeviceMark

log = logging.getLogger(__name__)


def channel_checksum(
    pairs: Sequence[RegionPair],
    views: Mapping[tuple[int, str], torch.Tensor],
    side: str,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    src_slot: int,
    dst_slot: int,
    stage_slot: int | None = None,
) -> tuple[int, int]:
    """(crc32, bytes) over a channel's ranges in plan order, read on `side` ("src" | "dst"): on
    the source, what is written (a cast pair's staging region)."""
    reg, so, do, ln = expand_arrays(pairs, src_blocks, dst_blocks, src_slot, dst_slot, stage_slot)
    offs = so if side == "src" else do
    crc, total = 0, 0
    for r, o, n in zip(reg.tolist(), offs.tolist(), ln.tolist()):
        p = pairs[r]
        crc = zlib.crc32(host_bytes(views[src_key(p) if side == "src" else (p.layer, p.kind)][o : o + n]), crc)
        total += n
    return crc, total


class _Post(NamedTuple):
    """One queued post: whole layers (None: every one) or, with `pages`, the paged pairs' pages
    up to that count; `final` sends the rest and Done. `ready`: a device event after the kernels
    that computed the post's layers (a layer post inside a step); the post waits for it without
    blocking, the posts after it wait their turn. Without one, a post waits on the step fence."""

    layers: set[int] | None
    final: bool
    pages: int | None = None
    ready: DeviceMark | None = None


class _Channel:
    """This source rank -> one destination rank, for one request."""

    def __init__(self, dst: TargetRank, peer: Peer, dst_blocks: list[int]):
        self.dst, self.peer = dst, peer
        self.dst_blocks = dst_blocks  # the destination pages written (cached ones left out)
        self.granted: bool | None = None  # None: Begin sent, no answer yet
        self.tag_base = 0
        self.sent: set[int] = set()  # indices into peer.pairs already posted whole
        self.pages_sent = 0  # leading pages (of the request's written ones) every paged pair posted
        self.xfers: list[tuple[object, bool]] = []  # (transport handle, carries Done)
        self.final_posted = False
        self.done_sent = False  # Done delivered (with the last write or standalone)
        self.closed = False  # Done or Abort sent: the destination expects nothing more
        self.pending_done: bytes | None = None  # Done to send once earlier parts landed


class SendRequest:
    def __init__(
        self,
        sender: Sender,
        request_id: str,
        target: Target,
        src_blocks: list[int],
        src_slot: int,
        num_tokens: int,
        owned: bool,
    ):
        self.sender, self.request_id, self.target = sender, request_id, target
        self.src_blocks, self.src_slot, self.num_tokens, self.owned = src_blocks, src_slot, num_tokens, owned
        self.xfer_blocks, _ = skip_cached(src_blocks, src_blocks, target.cached_blocks)  # the pages read
        self.state = TransferState.PENDING
        self.error: str | None = None
        self.ended = False  # aborted because the request ended on its own (Abort.ended)
        self.asked = False  # failed because a destination's caller asked (Release.asked)
        self.channels: dict[int, _Channel] = {}
        self.queued: list[_Post] = []  # posts waiting for grants
        self.opened_at = time.monotonic()
        self.failed_at: float | None = None
        self.quiet = False  # no write can still read the source memory; owned memory freed
        self.nbytes = 0
        self.writes = 0  # WRITEs of data posted (to every destination rank), for observability
        self.staged: set[tuple[int, str]] = set()  # staging regions its slot was cast into
        self.stage_slot: int | None = None  # its staging slot (transfer/staging.py), held until quiet

    # -- caller API ----------------------------------------------------------------------------

    def post(self, layers: Iterable[int] | None = None, final: bool = True, ready: DeviceMark | None = None) -> None:
        """Write the plan's ranges of `layers` (None: every layer not yet sent): a layer's pages
        not yet written (its whole prompt once its last chunk passed the layer) and its GDN state;
        `final` sends the rest and Done. Queued until every destination granted and, with
        `ready` (an event after the layers' kernels), until the device passed it; no-op once failed."""
        if self.state is TransferState.FAILED:
            return
        if self.queued and self.queued[-1].final:
            raise TransferError(f"request {self.request_id}: already posted its final part")
        self.queued.append(_Post(None if layers is None else set(layers), final, None, ready))
        self.sender._advance(self)

    def post_pages(self, num_pages: int) -> None:
        """Write every paged pair's pages of the prompt's first `num_pages` pages (KV computed by
        the prompt chunks so far) not yet written; the GDN state and the rest go with the final
        post. Cached pages the destination holds are never written. A transport that cannot
        write part of a region's pages (UCXX: one tag per planned range) leaves it all to the
        final post."""
        if self.state is TransferState.FAILED or not self.sender.transport.partial_pages:
            return
        if self.queued and self.queued[-1].final:
            raise TransferError(f"request {self.request_id}: already posted its final part")
        n = min(num_pages - self.target.cached_blocks, len(self.xfer_blocks))
        if n > 0:
            self.queued.append(_Post(None, False, n))
            self.sender._advance(self)

    def poll(self) -> TransferState:
        self.sender.poll()
        return self.state

    def failure(self) -> str | None:
        return self.error

    def abort(self, reason: str = "aborted by the sender", ended: bool = False) -> None:
        """ended: the request ended on its own before its push (the receiver need not warn)."""
        self.sender._fail(self, reason, ended=ended)

    def release(self) -> None:
        """Check that a request is over: terminal and quiet (then its owned memory is back and the
        sender has already forgotten it). Raises while a write may still read the source pages."""
        if not (self.state.terminal and self.quiet):
            raise TransferError(f"request {self.request_id} is {self.state.value}; release it once terminal and quiet")


class Sender(Endpoint):
    role = "sender"

    def _init_role(self) -> None:
        self.requests: dict[str, SendRequest] = {}
        self.staging = Staging(self.transport, self.views if self.config.checksum else None, self.config.staging_slots)

    def _pairs(self, info: PeerInfo) -> tuple[RegionPair, ...]:
        return self.staging.bind(pair_templates(self.schema, info.schema))

    def _peer_added(self, peer: Peer) -> None:
        if peer.pairs:
            self.transport.prepare(peer.agent, peer.pairs)  # descriptor lists, once per peer

    def _peer_removed(self, peer: Peer, reason: str) -> None:
        for req in list(self.requests.values()):
            for ch in req.channels.values():
                if ch.peer is peer and not ch.closed:
                    for x, _ in ch.xfers:
                        self.transport.release(x, force=True)
                    ch.xfers.clear()
                    ch.closed = True
                    self._fail(req, f"destination agent {peer.agent} removed ({reason})")

    # -- open / post ---------------------------------------------------------------------------

    def open(
        self,
        request_id: str,
        target: Target,
        src_blocks: list[int],
        src_slot: int,
        num_tokens: int,
        owned: bool = False,
        rope_delta: int = 0,
    ) -> SendRequest:
        """Start a request: Begin to every destination rank this rank has bytes for (with the
        request's `rope_delta`, what the destination's positions continue from).

        `owned`: the source blocks and slot go back to this endpoint's BlockManager / SlotPool
        once the request is quiet (done, or failed with no write in flight).
        """
        old = self.requests.get(request_id)
        if old is not None:
            raise TransferError(f"request {request_id} is already open on {self.agent} ({old.state.value})")
        if not feeds(self.digest, target.digest):
            raise TransferError(
                f"target {request_id} is for model digest {target.digest}, this rank serves {self.digest}"
            )
        bs = self.schema.block_size
        if len(src_blocks) != -(-num_tokens // bs):
            raise PlanError(f"{num_tokens} tokens need {-(-num_tokens // bs)} blocks of {bs}, got {len(src_blocks)}")
        req = SendRequest(self, request_id, target, list(src_blocks), src_slot, num_tokens, owned)
        for tr in target.ranks:
            peer = self.peers.get(tr.agent)
            if peer is None:
                raise TransferError(f"destination agent {tr.agent} (rank {tr.rank}) is not connected; add_peer first")
            if not peer.pairs:
                continue
            if len(tr.blocks) < len(src_blocks):
                raise PlanError(
                    f"destination rank {tr.rank} reserved {len(tr.blocks)} blocks, {len(src_blocks)} needed"
                )
            check_ids(peer.pairs, src_blocks, tr.blocks[: len(src_blocks)], src_slot, tr.slot)
            _, dst_blocks = skip_cached(src_blocks, tr.blocks[: len(src_blocks)], target.cached_blocks)
            req.channels[tr.rank] = _Channel(tr, peer, dst_blocks)
        self.requests[request_id] = req
        for ch in req.channels.values():
            self._send(
                ch.peer.agent,
                Begin(
                    request_id,
                    ch.dst.incarnation,
                    self.agent,
                    self.node,
                    self.rank,
                    self.schema.tp_size,
                    num_tokens,
                    req.xfer_blocks,
                    src_slot,
                    ch.dst_blocks,
                    ch.dst.slot,
                    target.cached_blocks,
                    rope_delta,
                ),
            )
        if not req.channels:
            req.state = TransferState.DONE  # nothing of this rank is needed (e.g. a KV replica)
            self._settle(req)
        return req

    def renew(self, target: Target) -> int:
        """Restart the lease of `target`'s reservation on every destination rank this rank has
        bytes for (the request is queued, prefilling or pushing here). Returns the ranks told."""
        n = 0
        for tr in target.ranks:
            peer = self.peers.get(tr.agent)
            if peer is not None and peer.pairs:
                n += self._send(tr.agent, Renew(target.request_id, tr.incarnation, self.agent, self.node))
        return n

    def withdraw(self, target: Target, reason: str) -> int:
        """The request ended here before its push opened: an Abort (never granted, no fault) to
        every destination rank this rank has bytes for, which frees the reservation there."""
        n = 0
        for tr in target.ranks:
            peer = self.peers.get(tr.agent)
            if peer is not None and peer.pairs:
                msg = Abort(target.request_id, tr.incarnation, self.agent, self.rank, reason, True, granted=False)
                n += self._send(tr.agent, msg)
        return n

    def send(
        self,
        request_id: str,
        target: Target,
        src_blocks: list[int],
        src_slot: int,
        num_tokens: int,
        owned: bool = False,
        rope_delta: int = 0,
    ) -> SendRequest:
        """open() + post(final=True): the whole state in one write per destination rank."""
        req = self.open(request_id, target, src_blocks, src_slot, num_tokens, owned, rope_delta)
        req.post()
        return req

    def _advance(self, req: SendRequest) -> None:
        """Run queued posts once every channel is granted."""
        if req.state.terminal or not req.queued or not all(ch.granted for ch in req.channels.values()):
            return
        try:
            fenced = False
            while req.queued:
                post = req.queued[0]
                chans = ((ch.peer.pairs, ch.sent) for ch in req.channels.values())
                if req.stage_slot is None and post.pages is None and casts_in(chans, post.layers, post.final):
                    req.stage_slot = self.staging.allocate()
                    if req.stage_slot is None:  # every staging slot held: retried from _tick
                        break
                if post.ready is not None:  # a layer of a step still running: posted once it ran
                    if not post.ready.query():
                        break
                elif not fenced and self.fence is not None:  # the step that wrote these pages may still run
                    self.fence.wait()
                    fenced = True
                req.queued.pop(0)
                for ch in req.channels.values():
                    self._post(req, ch, post)
        except Exception as e:  # noqa: BLE001 (a backend refusing a post fails this request only)
            self._fail(req, f"posting a write failed: {e}")
            return
        if req.state is TransferState.PENDING and any(ch.xfers or ch.final_posted for ch in req.channels.values()):
            req.state = TransferState.TRANSFERRING

    def _post(self, req: SendRequest, ch: _Channel, post: _Post) -> None:
        pairs = ch.peer.pairs
        first = ch.pages_sent  # pages before it went with earlier page posts (paged pairs not sent whole)
        if post.pages is not None:
            todo = [i for i in range(len(pairs)) if i not in ch.sent and pairs[i].paged]
            upto = max(first, post.pages)
            ch.pages_sent = upto
        else:
            todo = [
                i
                for i in range(len(pairs))
                if i not in ch.sent and (post.final or post.layers is None or pairs[i].layer in post.layers)
            ]
            upto = len(req.xfer_blocks)
            ch.sent.update(todo)
        src_blocks, dst_blocks = req.xfer_blocks[first:upto], ch.dst_blocks[first:upto]
        if post.pages is not None and not src_blocks:
            return
        if req.stage_slot is not None:  # before any read of the staging slot
            self.staging.cast([pairs[i] for i in todo], req.src_slot, req.stage_slot, req.staged)
        notif = None
        if post.final:
            ch.final_posted = True
            crc = None
            if self.config.checksum:
                crc, _ = channel_checksum(
                    pairs, self.views, "src", req.xfer_blocks, ch.dst_blocks, req.src_slot, ch.dst.slot, req.stage_slot
                )
            nbytes = plan_nbytes(pairs, len(req.xfer_blocks))  # on the post's path: no expansion
            req.nbytes += nbytes
            done = Done(req.request_id, ch.dst.incarnation, self.agent, self.rank, nbytes, crc)
            notif = encode_control(done)
            if ch.xfers:  # earlier parts still in flight: Done goes standalone once they landed
                ch.pending_done = notif
                notif = None
        items = [(i, pairs[i]) for i in todo]
        job = WriteJob(items, src_blocks, dst_blocks, req.src_slot, ch.dst.slot, notif, ch.tag_base, req.stage_slot)
        if todo or notif is not None:
            x = self.transport.write(ch.peer.agent, job)
            ch.xfers.append((x, notif is not None))
            req.writes += bool(todo)  # a job of no ranges is a standalone Done

    # -- events --------------------------------------------------------------------------------

    def _lookup(self, msg: Grant | Refuse | Release) -> tuple[SendRequest, _Channel] | None:
        req = self.requests.get(msg.request_id)
        if req is not None:
            for ch in req.channels.values():
                if ch.dst.incarnation == msg.incarnation and ch.peer.agent == msg.src:
                    return req, ch
        self._stale(f"{type(msg).__name__} for {msg.request_id}/{msg.incarnation} from {msg.src}: no such channel")
        return None

    def _handle(self, msg: Control) -> None:
        if not isinstance(msg, (Grant, Refuse, Release)):
            self._stale(f"{type(msg).__name__} from {getattr(msg, 'src', '?')}: not a sender message")
            return
        found = self._lookup(msg)
        if found is None:
            return
        req, ch = found
        if isinstance(msg, Grant):
            if ch.granted is None:
                ch.granted, ch.tag_base = True, msg.tag_base
                self._advance(req)
        elif isinstance(msg, Refuse):
            ch.granted = False
            ch.closed = True  # a refused channel holds nothing on the destination
            self._fail(req, f"destination rank {ch.dst.rank} refused: {msg.reason}")
        else:
            self._fail(req, f"destination rank {ch.dst.rank} released the reservation: {msg.reason}", asked=msg.asked)

    def _fail(self, req: SendRequest, reason: str, ended: bool = False, asked: bool = False) -> None:
        """ended (Abort.ended) and asked (Release.asked) say the failure is no fault; they are
        recorded only by the failure that ends the request, never over an earlier one."""
        if req.state.terminal:
            return
        req.ended, req.asked = ended, asked
        log.info("%s: request %s failed: %s", self.agent, req.request_id, reason)
        req.state, req.error, req.failed_at = TransferState.FAILED, reason, time.monotonic()
        req.queued.clear()
        self._settle(req)

    def _tick(self, now: float) -> None:
        for req in list(self.requests.values()):
            if req.quiet:
                continue
            if req.queued:  # posts behind a layer's device event, or waiting for grants
                self._advance(req)
            for ch in req.channels.values():
                self._check_xfers(req, ch)
            waiting = [ch.dst.rank for ch in req.channels.values() if ch.granted is None]
            if waiting and not req.state.terminal and now - req.opened_at > self.config.grant_timeout_s:
                self._fail(req, f"no grant from destination ranks {waiting} within {self.config.grant_timeout_s} s")
            if req.state is TransferState.TRANSFERRING and all(ch.done_sent for ch in req.channels.values()):
                req.state = TransferState.DONE
            if req.failed_at is not None and now - req.failed_at > self.config.quiesce_timeout_s:
                for ch in req.channels.values():
                    for x, _ in ch.xfers:
                        self.transport.release(x, force=True)
                    ch.xfers.clear()
            self._settle(req)

    def _check_xfers(self, req: SendRequest, ch: _Channel) -> None:
        keep = []
        for x, carries_done in ch.xfers:
            st = self.transport.state(x)
            if st is TransferState.TRANSFERRING:
                keep.append((x, carries_done))
                continue
            self.transport.release(x)
            if st is TransferState.FAILED:
                self._fail(req, f"write to destination rank {ch.dst.rank} failed")
            elif carries_done:
                ch.done_sent = ch.closed = True
        ch.xfers = keep
        if ch.pending_done is not None and not ch.xfers and req.state is not TransferState.FAILED:
            try:
                self.transport.send_control(ch.peer.agent, ch.pending_done)
            except Exception as e:  # noqa: BLE001
                self._fail(req, f"Done to destination rank {ch.dst.rank} not sent: {e}")
                return
            ch.pending_done = None
            ch.done_sent = ch.closed = True

    def _settle(self, req: SendRequest) -> None:
        """Once nothing is in flight: tell granted destinations we stopped, free owned memory."""
        if req.quiet or not req.state.terminal:
            return
        if any(ch.xfers for ch in req.channels.values()):
            return
        # a destination that has the Begin may be granting it as the request fails (a client gone at
        # its first token): wait for its answer, within the grant timeout from the Begin, so that the
        # receives a two-sided transport posted for that Grant are drained below, not left waiting
        if time.monotonic() - req.opened_at < self.config.grant_timeout_s and any(
            ch.granted is None and not ch.closed and ch.peer.agent in self.peers for ch in req.channels.values()
        ):
            return
        for ch in req.channels.values():
            if ch.closed or ch.peer.agent not in self.peers:
                continue
            if ch.granted:
                unsent = [(i, p) for i, p in enumerate(ch.peer.pairs) if i not in ch.sent]
                self.transport.drain(
                    ch.peer.agent, unsent, req.xfer_blocks, ch.dst_blocks, req.src_slot, ch.dst.slot, ch.tag_base
                )
            self._send(
                ch.peer.agent,
                Abort(
                    req.request_id,
                    ch.dst.incarnation,
                    self.agent,
                    self.rank,
                    req.error or "aborted",
                    req.ended,
                    granted=ch.granted is True,
                ),
            )
            ch.closed = True
        req.quiet = True
        if req.stage_slot is not None:
            self.staging.free(req.stage_slot)
        if req.owned:
            self.blocks.free(req.src_blocks)
            self.slots.free(req.src_slot)
        if self.requests.get(req.request_id) is req:
            del self.requests[req.request_id]  # the caller keeps the object; late messages are stale
