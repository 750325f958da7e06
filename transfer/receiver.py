"""The decode side of one rank: reserves memory for a request under a lease, grants writes into it
and completes the request once every source rank reported Done; memory is freed only when no
write can still land. Lifecycle: docs/transfer.md, "Module notes"."""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

from transfer.backend import TransferState
from transfer.endpoint import Endpoint, Peer
from transfer.errors import PlanError, TransferError
from transfer.messages import Abort, Begin, Control, Done, Grant, Refuse, Release, Renew, Target, TargetRank
from transfer.plan import RegionPair, check_ids, pair_templates
from transfer.schema import PeerInfo
from transfer.sender import channel_checksum

log = logging.getLogger(__name__)


class RecvRequest:
    def __init__(
        self,
        receiver: Receiver,
        request_id: str,
        incarnation: int,
        blocks: list[int],
        slot: int,
        prompt_len: int,
        lease_s: float,
        cached_blocks: int = 0,
    ):
        self.receiver, self.request_id, self.incarnation = receiver, request_id, incarnation
        self.blocks, self.slot, self.prompt_len = blocks, slot, prompt_len
        self.cached_blocks = cached_blocks  # leading pages that hold the prompt's KV already: not written
        self.lease_s = lease_s
        self.deadline = time.monotonic() + lease_s
        self.renewals = 0  # Renew messages that restarted the lease
        self.expired = False  # failed because the lease ran out
        self.ended = False  # failed because a source's request ended on its own (Abort.ended)
        self.asked = False  # failed because the caller asked (Release.asked)
        self.state = TransferState.PENDING
        self.error: str | None = None
        self.node: str | None = None  # the source node, bound by the first Begin
        self.expected: set[int] = set()  # source ranks with bytes for this rank
        self.begins: dict[int, Begin] = {}  # granted source rank -> its Begin
        self.expects: dict[int, object] = {}  # source rank -> backend receive handle (two-sided)
        self.dones: dict[int, Done] = {}  # Done received, bytes may still be settling
        self.finished: set[int] = set()  # source ranks whose bytes all landed (and checked)
        self.quiet: set[int] = set()  # granted source ranks that can no longer write here
        self.freed = False
        self.taken = False
        self.free_fn: Callable[[list[int], int], None] | None = None  # set by Receiver.adopt

    @property
    def target(self) -> TargetRank:
        r = self.receiver
        return TargetRank(r.agent, r.rank, list(self.blocks), self.slot, self.incarnation)

    def poll(self) -> TransferState:
        self.receiver.poll()
        return self.state

    def failure(self) -> str | None:
        return self.error

    def abort(self, reason: str = "aborted by the receiver", asked: bool = False) -> None:
        """asked: the caller (the router, through the decode node) asked for it: Release.asked."""
        if self.state is TransferState.DONE:
            self.release()
        else:
            self.receiver._fail(self, reason, asked=asked)

    @property
    def rope_delta(self) -> int | None:
        """The position offset the sources' Begins carried (None before any Begin)."""
        return next((b.rope_delta for b in self.begins.values()), None)

    def take(self) -> tuple[list[int], int]:
        """Hand a DONE request's blocks and slot to the engine (which frees them when it finishes)."""
        if self.state is not TransferState.DONE or self.freed:
            raise TransferError(f"request {self.request_id} is {self.state.value}; only a done request is taken")
        self.taken = self.freed = True
        self.receiver._forget(self)
        return self.blocks, self.slot

    def release(self) -> None:
        """Free a DONE request's memory without using it. Failed requests free themselves when safe."""
        if self.state is not TransferState.DONE:
            raise TransferError(f"request {self.request_id} is {self.state.value}; abort() it instead")
        if not self.freed:
            self.receiver._free(self)


class Receiver(Endpoint):
    role = "receiver"

    def _init_role(self) -> None:
        self.requests: dict[tuple[str, int], RecvRequest] = {}
        self.recent: OrderedDict[tuple[str, int], str] = OrderedDict()  # ended reservations -> why
        self.recent_expired: set[tuple[str, int]] = set()  # those of `recent` whose lease ran out
        self.recent_ended: set[tuple[str, int]] = set()  # those of `recent` a source's own end failed

    def _pairs(self, info: PeerInfo) -> tuple[RegionPair, ...]:
        return pair_templates(info.schema, self.schema)

    # -- reservations --------------------------------------------------------------------------

    def reserve(
        self, request_id: str, prompt_len: int, lease_s: float | None = None, incarnation: int | None = None
    ) -> RecvRequest:
        """KV blocks for prompt_len + 1 tokens and one state slot from this endpoint's BlockManager /
        SlotPool, under a lease; raises MemoryError when they do not fit."""
        n = self.blocks.blocks_for(prompt_len + 1)
        if not self.blocks.can_allocate(n) or self.slots.num_free == 0:
            raise MemoryError(
                f"{self.agent}: need {n} KV blocks and a state slot; "
                f"{self.blocks.num_free} blocks and {self.slots.num_free} slots free"
            )
        blocks = self.blocks.allocate(n)
        slot = self.slots.allocate()
        assert slot is not None  # a slot was free (checked above)
        return self.adopt(request_id, prompt_len, blocks, slot, lease_s, incarnation)

    def adopt(
        self,
        request_id: str,
        prompt_len: int,
        blocks: list[int],
        slot: int,
        lease_s: float | None = None,
        incarnation: int | None = None,
        free: Callable[[list[int], int], None] | None = None,
        cached_blocks: int = 0,
    ) -> RecvRequest:
        """Reserve memory the caller already allocated (e.g. the engine's scheduler). When the
        reservation fails, `free(blocks, slot)` is called once no write can land (default: this
        endpoint's BlockManager / SlotPool); a done request is handed back by take(). The first
        `cached_blocks` blocks already hold the prompt's KV: sources leave them out."""
        if not 0 <= cached_blocks <= min(len(blocks), prompt_len // self.schema.block_size):
            raise TransferError(
                f"{cached_blocks} cached blocks in a reservation of {len(blocks)} for {prompt_len} tokens"
            )
        inc = incarnation if incarnation is not None else secrets.randbits(62)
        if (request_id, inc) in self.requests:
            raise TransferError(f"reservation {request_id}/{inc} exists on {self.agent}")
        req = RecvRequest(
            self, request_id, inc, list(blocks), slot, prompt_len, lease_s or self.config.lease_s, cached_blocks
        )
        req.free_fn = free
        self.requests[(request_id, inc)] = req
        return req

    def target(self, ranks: list[TargetRank], request_id: str, prompt_len: int, cached_blocks: int = 0) -> Target:
        """The node-wide target (every destination rank's TargetRank, by rank) to hand to the router."""
        return Target(
            request_id,
            self.node,
            self.schema.tp_size,
            self.digest,
            prompt_len,
            sorted(ranks, key=lambda t: t.rank),
            cached_blocks,
        )

    # -- protocol events -----------------------------------------------------------------------

    def _handle(self, msg: Control) -> None:
        if isinstance(msg, Begin):
            self._begin(msg)
        elif isinstance(msg, Renew):
            self._renew(msg)
        elif isinstance(msg, (Done, Abort)):
            req = self.requests.get((msg.request_id, msg.incarnation))
            b = req.begins.get(msg.rank) if req is not None else None
            if req is not None and b is None and isinstance(msg, Abort) and msg.src in self.peers:
                self._fail(req, f"source rank {msg.rank} aborted before writing: {msg.reason}", ended=msg.ended)
                return
            if req is None or b is None or b.src != msg.src or msg.rank in req.quiet:
                why = self.recent.get((msg.request_id, msg.incarnation), "no live reservation")
                self._stale(f"{type(msg).__name__} for {msg.request_id}/{msg.incarnation} from {msg.src} ({why})")
                return
            if isinstance(msg, Done):
                req.dones[msg.rank] = msg
            else:
                req.quiet.add(msg.rank)
                if not msg.granted:  # it never had our Grant: nothing comes for the receives posted for it
                    self.transport.release(req.expects.pop(msg.rank, None), force=True)
                self._fail(req, f"source rank {msg.rank} aborted: {msg.reason}", ended=msg.ended)
        else:
            self._stale(f"{type(msg).__name__} from {msg.src}: not a receiver message")

    def _begin(self, msg: Begin) -> None:
        peer = self.peers.get(msg.src)
        if peer is None:
            self._stale(f"Begin for {msg.request_id} from unknown agent {msg.src}")
            return
        req = self.requests.get((msg.request_id, msg.incarnation))
        try:
            if req is None:
                why = self.recent.get((msg.request_id, msg.incarnation))
                raise TransferError(
                    f"reservation {msg.request_id}/{msg.incarnation} was released ({why})"
                    if why
                    else f"no reservation {msg.request_id}/{msg.incarnation} on {self.agent}"
                )
            if req.state.terminal:
                raise TransferError(f"reservation {msg.request_id} is {req.state.value}: {req.error}")
            self._check_begin(req, peer, msg)
        except (TransferError, PlanError) as e:
            self._send(msg.src, Refuse(msg.request_id, msg.incarnation, self.agent, str(e)))
            if req is not None and not req.state.terminal:
                self._fail(req, f"refused source rank {msg.rank}: {e}")
            return
        tag_base = self.transport.new_tag_base()
        req.expects[msg.rank] = self.transport.expect(
            msg.src, peer.pairs, msg.src_blocks, msg.dst_blocks, msg.src_slot, msg.dst_slot, tag_base
        )
        req.begins[msg.rank] = msg
        req.state = TransferState.TRANSFERRING
        self._send(msg.src, Grant(msg.request_id, msg.incarnation, self.agent, tag_base))

    def _renew(self, msg: Renew) -> None:
        """A source that still works on the request (queued, prefilling, pushing) restarts its lease."""
        req = self.requests.get((msg.request_id, msg.incarnation))
        peer = self.peers.get(msg.src)
        if req is None or peer is None or peer.info.node != msg.node or req.node not in (None, msg.node):
            why = self.recent.get((msg.request_id, msg.incarnation), "no live reservation")
            self._stale(f"Renew for {msg.request_id}/{msg.incarnation} from {msg.src} ({why})")
            return
        if not req.state.terminal:
            req.deadline = max(req.deadline, time.monotonic() + req.lease_s)
            req.renewals += 1

    def _check_begin(self, req: RecvRequest, peer: Peer, msg: Begin) -> None:
        if req.node is None:
            group = {p.rank: p for p in self.peers.values() if p.info.node == msg.node}
            missing = sorted(set(range(msg.tp_size)) - set(group))
            if missing:
                raise TransferError(f"source ranks {missing} of node {msg.node} are not connected to {self.agent}")
            req.node = msg.node
            req.expected = {r for r, p in group.items() if p.pairs}
        if msg.node != req.node:
            raise TransferError(f"request {req.request_id} is bound to source node {req.node}, not {msg.node}")
        if msg.rank not in req.expected or msg.rank in req.begins:
            raise TransferError(f"unexpected or repeated Begin from source rank {msg.rank}")
        if req.rope_delta not in (None, msg.rope_delta):
            raise TransferError(f"source rank {msg.rank} sends rope_delta {msg.rope_delta}, another {req.rope_delta}")
        bs, k = self.schema.block_size, req.cached_blocks
        if msg.cached_blocks != k:
            raise TransferError(f"source skips {msg.cached_blocks} cached blocks, this reservation has {k}")
        if msg.num_tokens > req.prompt_len or k + len(msg.src_blocks) != -(-msg.num_tokens // bs):
            raise TransferError(
                f"{msg.num_tokens} tokens in {k} cached + {len(msg.src_blocks)} blocks do not fit a "
                f"reservation for {req.prompt_len} tokens"
            )
        want = req.blocks[k : k + len(msg.src_blocks)]
        if msg.dst_blocks != want or msg.dst_slot != req.slot:
            raise TransferError(f"ids {msg.dst_blocks}/{msg.dst_slot} are not this reservation's {want}/{req.slot}")
        check_ids(peer.pairs, msg.src_blocks, msg.dst_blocks, msg.src_slot, msg.dst_slot)

    def _peer_removed(self, peer: Peer, reason: str) -> None:
        for req in list(self.requests.values()):
            if req.state is TransferState.DONE:
                continue
            granted = peer.rank in req.begins and req.begins[peer.rank].src == peer.agent
            if granted:
                req.quiet.add(peer.rank)
                req.expects.pop(peer.rank, None)  # the transport cancels its posted receives
            if granted or (req.node == peer.info.node and peer.rank in req.expected):
                self._fail(req, f"source agent {peer.agent} removed ({reason})")

    # -- state changes -------------------------------------------------------------------------

    def _fail(self, req: RecvRequest, reason: str, ended: bool = False, asked: bool = False) -> None:
        """ended (Abort.ended) and asked (the caller's abort: Release.asked) say the failure is no
        fault; they are recorded only by the failure that ends the request, never over an earlier one."""
        if req.state.terminal:
            return
        req.ended, req.asked = ended, asked
        log.info("%s: request %s/%s failed: %s", self.agent, req.request_id, req.incarnation, reason)
        req.state, req.error = TransferState.FAILED, reason
        for rank, b in req.begins.items():
            if rank not in req.quiet and rank not in req.finished:
                self._send(b.src, Release(req.request_id, req.incarnation, self.agent, reason, req.asked))
        self._maybe_free(req)

    def _maybe_free(self, req: RecvRequest) -> None:
        """Free a failed reservation once no granted source can still write into it."""
        if req.freed or req.state is not TransferState.FAILED:
            return
        for rank in req.begins:
            if rank not in req.quiet and rank not in req.finished:
                return
            if self.transport.expect_state(req.expects.get(rank)) is TransferState.TRANSFERRING:
                return
        self._free(req)

    def _free(self, req: RecvRequest) -> None:
        for h in req.expects.values():
            self.transport.release(h, force=True)
        req.expects.clear()
        if req.free_fn is not None:
            req.free_fn(req.blocks, req.slot)
        else:
            self.blocks.free(req.blocks)
            self.slots.free(req.slot)
        req.freed = True
        self._forget(req)

    def _forget(self, req: RecvRequest) -> None:
        key = (req.request_id, req.incarnation)
        self.requests.pop(key, None)
        self.recent[key] = req.error or req.state.value
        if req.expired:
            self.recent_expired.add(key)
        if req.ended:
            self.recent_ended.add(key)
        while len(self.recent) > 4096:
            old = self.recent.popitem(last=False)[0]
            self.recent_expired.discard(old)
            self.recent_ended.discard(old)

    def _tick(self, now: float) -> None:
        for req in list(self.requests.values()):
            for rank, done in list(req.dones.items()):
                st = self.transport.expect_state(req.expects.get(rank))
                if st is TransferState.TRANSFERRING:
                    continue
                del req.dones[rank]
                req.quiet.add(rank)
                if st is TransferState.FAILED:
                    self._fail(req, f"receiving from source rank {rank} failed")
                elif self._verify(req, rank, done):
                    req.finished.add(rank)
            if not req.state.terminal and req.expected and req.finished >= req.expected:
                req.state = TransferState.DONE
            if not req.state.terminal and now > req.deadline:
                req.expired = True
                self._fail(req, f"lease expired ({'no source began' if not req.begins else 'transfer incomplete'})")
            self._maybe_free(req)

    def _verify(self, req: RecvRequest, rank: int, done: Done) -> bool:
        if not self.config.checksum:
            return True
        if done.checksum is None:
            self._fail(req, f"source rank {rank} sent no checksum; this receiver requires one")
            return False
        b = req.begins[rank]
        peer = self.peers.get(b.src)
        if peer is None:
            self._fail(req, f"source rank {rank} was removed before its checksum was checked")
            return False
        crc, n = channel_checksum(peer.pairs, self.views, "dst", b.src_blocks, b.dst_blocks, b.src_slot, b.dst_slot)
        if (crc, n) != (done.checksum, done.nbytes):
            self._fail(
                req,
                f"checksum mismatch from source rank {rank}: got crc {crc:#010x} over {n} bytes, "
                f"sender reported {done.checksum:#010x} over {done.nbytes}",
            )
            return False
        return True
