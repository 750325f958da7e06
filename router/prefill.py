"""The prefill phase of a disaggregated request: the prefill window, the brokered handshake, the
decode node's reservation, the Prefill stream (first token, then the push) and one retry
elsewhere; the task that watches each push is router/push.py (docs/router.md, "Life of a request
across the pools")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import grpc

from proto import pb
from router.config import RouterConfig
from router.encode import EncodePool
from router.errors import Abort, DecodeFailed
from router.migrate import NodeLost, NodeWatch, watched
from router.prefix import PrefixQuery
from router.push import Push
from router.registry import NodeEntry, NodeRegistry
from router.state_digest import feeds
from router.wait_estimate import RateMeter, node_rate
from serving.rpc import is_draining, peer_at_fault

PREFILL_DEADLINE_MARGIN = 2.0  # a Prefill call's deadline allows twice its tokens' time at the node's rate

log = logging.getLogger("pdserve.router")


class PrefillPhase:
    """Owns the prefill nodes' `inflight_prefill_tokens` (counted in `choose`, given back when
    the first token is back or the call failed) and the handshaken pairs."""

    def __init__(self, cfg: RouterConfig, registry: NodeRegistry, policy, spawn: Callable):
        self.cfg, self.registry, self.policy = cfg, registry, policy
        self._spawn = spawn  # runs a coroutine as a task the router keeps until it ends
        self._pairs: set[tuple] = set()  # (prefill id, incarnation, decode id, incarnation) handshaken
        self._pair_locks: dict[tuple, asyncio.Lock] = {}  # one a pair: a slow pair holds up no other
        self._warming: set[tuple] = set()  # pairs `warm_pairs` is handshaking ahead of any request
        self._told: set[tuple] = set()  # pairs whose state schemas differ, logged once (`_explain`)
        self.meter = RateMeter()  # each prefill node's measured rate (admission's estimate)
        self.encode: EncodePool | None = None  # the encode pool's step (set by the service)

    def ready(self, d: NodeEntry | None, exclude: set[str], prompt_len: int = 0) -> list[NodeEntry]:
        """Prefill nodes that take prompts now for decode node d (its model's schema; None: for a
        request that needs no decode node) and whose cache can hold a prompt of `prompt_len`
        tokens (0: any prompt)."""
        dg = d.info.schema_digest if d is not None else ""
        return [
            p
            for p in self.registry.routable(pb.NODE_KIND_PREFILL)
            if p.info.prefill_ready
            and p.node_id not in exclude
            and (not dg or not p.info.schema_digest or feeds(p.info.schema_digest, dg))
            and p.holds(prompt_len)
        ]

    def use_pool(self, d: NodeEntry, prompt_len: int, cached: int = 0) -> bool:
        """Conditional disaggregation: short prompts (under D's threshold) prefill on D, as do
        the next turns of conversations D holds (`cached` tokens usable there, fewer new ones
        than D's resume threshold: their state is on D, a prefill node would compute it again),
        and all prompts when no prefill node is ready (or none holds the whole prompt: a prefill
        node at TP 1 beside a decode node at TP 2 holds half the tokens) or every one is loaded past
        `max_prefill_queue_tokens`. prompt_len: what D would compute (cache-aware routing passes
        the prompt less D's usable cached prefix, `cached`)."""
        info = d.info
        if prompt_len < info.local_prefill_threshold or not info.schema_digest:
            return False
        if cached and prompt_len < info.local_resume_threshold:
            return False
        ready = self.ready(d, set(), prompt_len + cached)
        limit = self.cfg.max_prefill_queue_tokens
        if limit and ready:
            with self.registry.lock:
                queued = [p.queued_prefill_tokens() for p in ready]
            if min(queued) >= limit:
                return False
        return bool(ready)

    def choose(
        self,
        d: NodeEntry | None,
        prompt_len: int,
        exclude: set[str],
        window: bool,
        q: PrefixQuery | None = None,
        batch: bool = False,
    ) -> tuple[NodeEntry, int] | None:
        """A ready prefill node for D (within its window when `window`) and the prompt tokens it
        is counted to compute (the prompt less what it has cached, as the router knows its cache),
        counted against it until `_given_back`; None when there is none. q: the prompt's page
        hashes, for a policy that weighs what each node has cached (and for the count). An
        interactive prompt's window counts only the interactive prompts outstanding there: the
        node schedules it before batch ones."""
        w = self.cfg.prefill_window_tokens

        def work(p: NodeEntry) -> int:
            return prompt_len - (p.cache.usable(q, compute=True) if q is not None else 0)

        with self.registry.lock:
            nodes = self.ready(d, exclude, prompt_len)
            if window and w:
                nodes = [p for p in nodes if (n := p.outstanding(batch)) == 0 or n + work(p) <= w]
            p = self.policy.choose_prefill(nodes, prompt_len, q)
            if p is None:
                return None
            tokens = work(p)
            if not p.inflight_prefill_tokens:
                self.meter.busy(p.node_id)
            p.prefill_sent(tokens, interactive=not batch)
        return p, tokens

    def _given_back(self, p: NodeEntry, rid: str, tokens: int, ok: bool, batch: bool) -> None:
        """What `choose` counted against p leaves it, and the encode pool the pushes for `rid`. ok:
        the first token came back (the prefill is measured)."""
        if self.encode is not None:
            self.encode.taken(p, rid)
        if ok:
            self.meter.done(p.node_id, tokens)
        with self.registry.lock:
            p.prefill_back(tokens, interactive=not batch)
        self.registry.on_change()  # within its window again: admit the next

    @staticmethod
    def _pair_key(p: NodeEntry, d: NodeEntry) -> tuple:
        return (p.node_id, p.info.incarnation, d.node_id, d.info.incarnation)

    async def handshake(self, p: NodeEntry, d: NodeEntry) -> None:
        """Broker the transfer handshake of (P, D) once per pair of incarnations. A P the heartbeats
        declare dead meanwhile ends it with NodeLost (UNAVAILABLE), as it ends a Prefill call: the
        Handshake of a hung P otherwise held the pair's lock, and every request for the pair
        waiting behind it, for the calls' 60 s. A D declared dead meanwhile ends it the same way,
        as D's failure (DecodeFailed: the request goes to another decode node). A failure of D's (D's own Handshake failing, or P
        answering that D's transfer agent is unreachable: `peer_at_fault`) raises DecodeFailed,
        which places the request on another decode node; any other is P's."""
        key = self._pair_key(p, d)
        if key in self._pairs:
            return
        shake = asyncio.ensure_future(self._handshake(p, d, key))  # cancelled with the caller
        dwatch = NodeWatch(lambda: d.alive, shake.cancel, self.cfg.heartbeat_interval_s)  # a hung D, likewise
        try:
            await watched(p, lambda: shake, shake.cancel, self.cfg.heartbeat_interval_s)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not dwatch.lost or (task is not None and task.cancelling()):
                raise
            raise DecodeFailed(
                NodeLost(d.node_id, "was declared dead (no heartbeat) during the transfer handshake")
            ) from None
        finally:
            dwatch.stop()

    async def _handshake(self, p: NodeEntry, d: NodeEntry, key: tuple) -> None:
        async with self._pair_locks.setdefault(key, asyncio.Lock()):
            if key in self._pairs:
                return
            if not p.alive:  # declared dead while this waited for the pair's lock
                raise NodeLost(p.node_id, kind="prefill")
            if not d.alive:
                raise DecodeFailed(NodeLost(d.node_id))
            pr = await p.stub.Handshake(pb.HandshakeRequest(node_id="router"), timeout=60)
            try:  # D's own failure is D's (the request goes to another decode node); P's agent unreachable is P's
                dr = await d.stub.Handshake(
                    pb.HandshakeRequest(node_id=p.node_id, incarnation=p.info.incarnation, schema=pr.schema),
                    timeout=60,
                )
            except grpc.RpcError as e:
                if peer_at_fault(e) == p.node_id:
                    raise
                raise DecodeFailed(e) from None
            try:
                await p.stub.Handshake(
                    pb.HandshakeRequest(node_id=d.node_id, incarnation=d.info.incarnation, schema=dr.schema),
                    timeout=60,
                )
            except grpc.RpcError as e:  # P answered that D's transfer agent cannot be reached: D's fault
                if peer_at_fault(e) == d.node_id:
                    raise DecodeFailed(e) from None
                raise
            self._pairs.add(key)
            log.info("transfer handshake %s <-> %s done", p.node_id, d.node_id)

    def warm_pairs(self) -> None:
        """Start the handshake of every (ready prefill node, decode node) pair not yet made, in the
        background (on the router's loop): a node's first requests then do not wait for it (it
        costs tens of milliseconds, more on a busy host). A failure is left to the request path,
        which handshakes again and reports it."""
        for d in self.registry.routable(pb.NODE_KIND_DECODE):
            for p in self.ready(d, set()):
                key = self._pair_key(p, d)
                if key not in self._pairs and key not in self._warming:
                    self._warming.add(key)
                    self._spawn(self._warm(p, d, key))
            for p in self.registry.routable(pb.NODE_KIND_PREFILL):  # a pair that can never hand off: say why
                key = self._pair_key(p, d)
                if (
                    p.info.prefill_ready
                    and p.info.schema_digest
                    and not feeds(p.info.schema_digest, d.info.schema_digest)
                    and key not in self._told
                ):
                    self._told.add(key)
                    self._spawn(self._explain(p, d))

    async def _explain(self, p: NodeEntry, d: NodeEntry) -> None:
        """P's state cannot go to D (their model digests differ): one WARNING with the handshake's
        reason, which names the setting (docs/router.md)."""
        why = f"their state schemas differ ({p.info.schema_digest} vs {d.info.schema_digest})"
        try:
            await self.handshake(p, d)
        except grpc.RpcError as e:
            why = e.details() or why
        except DecodeFailed as e:
            why = e.err.details() or why
        except Exception:  # noqa: BLE001 (the digests' difference is reason enough)
            pass
        log.warning(
            "prefill node %s cannot hand prompts to decode node %s: %s; %s computes its prompts itself "
            "until both pools run the same model and settings",
            p.node_id,
            d.node_id,
            why,
            d.node_id,
        )

    async def _warm(self, p: NodeEntry, d: NodeEntry, key: tuple) -> None:
        try:
            await self.handshake(p, d)
        except Exception as e:  # the node went away or is not up yet: a request will try again
            log.debug("early handshake %s <-> %s failed: %s", p.node_id, d.node_id, e)
        finally:
            self._warming.discard(key)

    def mark_dead(self, p: NodeEntry) -> None:
        """A call found P unreachable: no new prompts until its next heartbeat; handshakes again then."""
        with self.registry.lock:
            p.alive = False
        self.forget_prefill(p)

    def forget_decode(self, d: NodeEntry) -> None:
        self._pairs = {k for k in self._pairs if k[2] != d.node_id}

    def forget_prefill(self, p: NodeEntry) -> None:
        self._pairs = {k for k in self._pairs if k[0] != p.node_id}
        self._pair_locks = {k: v for k, v in self._pair_locks.items() if k[0] != p.node_id}

    def prune(self, known: dict[str, int]) -> None:
        """Drop the pairs (locks, warnings) of node incarnations the registry no longer knows."""
        keys = {*self._pairs, *self._pair_locks, *self._told}
        cur = {k for k in keys if (k[1], k[3]) == (known.get(k[0]), known.get(k[2]))}
        self._pairs, self._told = self._pairs & cur, self._told & cur
        self._pair_locks = {k: v for k, v in self._pair_locks.items() if k in cur or v.locked()}

    def forget_pair(self, p: NodeEntry, d: NodeEntry) -> None:
        """Handshake (P, D) again next time: a failed prefill may mean D dropped P's agents (another
        router declared P dead); the handshake is idempotent and cheap."""
        self._pairs = {k for k in self._pairs if (k[0], k[2]) != (p.node_id, d.node_id)}

    async def release(self, d: NodeEntry, rid: str, reason: str, dead_prefill: str = "") -> None:
        try:
            await d.stub.Release(
                pb.ReleaseRequest(request_id=rid, reason=reason, dead_prefill_node=dead_prefill), timeout=30
            )
        except grpc.RpcError as e:
            log.warning("release of %s on %s failed: %s", rid, d.node_id, e.code().name)

    def release_later(self, d: NodeEntry, rid: str, reason: str, dead_prefill: str = "") -> None:
        """Release from a path that is unwinding (a cancelled request): a task of its own."""
        self._spawn(self.release(d, rid, reason, dead_prefill))

    async def reserve(
        self, d: NodeEntry, rid: str, ids: list[int], request, images: Sequence[pb.ImageInput] = ()
    ) -> pb.TransferTarget:
        """D.Reserve, retried while D is momentarily full (bounded by the admission wait). The
        images go without their bytes: D names its cached pages by their pixel hashes."""
        deadline = time.monotonic() + self.cfg.admission_timeout_s
        req = pb.ReserveRequest(
            request_id=rid,
            prompt_token_ids=ids,
            sampling=request.sampling,
            lease_s=self.cfg.reservation_lease_s,
            images=[pb.ImageInput(pixel_hash=i.pixel_hash, offset=i.offset, grid_thw=i.grid_thw) for i in images],
        )
        while True:
            try:
                return (await d.stub.Reserve(req, timeout=30)).target
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.02)  # the node's memory frees on its own schedule: ask again shortly

    async def run(
        self,
        d: NodeEntry,
        chosen: tuple[NodeEntry, int],
        request,
        ids: list[int],
        request_id: str,
        images: Sequence[pb.ImageInput] = (),
    ) -> Push | None:
        """Reserve on D, prefill on P (`chosen`: P and the tokens admission counted against it;
        one retry elsewhere) until it streams the first token. Returns the Push (first token, the
        push still running), or None to prefill on D. `images`: the prompt's, for P (D gets their
        hashes only)."""
        p: NodeEntry | None
        p, counted = chosen
        tried: set[str] = set()
        batch = request.sampling.priority == pb.PRIORITY_BATCH
        attempt = 0  # reservations made (each under its own id)
        failures = 0  # prefill calls that failed (a drain refusal is not one)
        while True:
            if p is None:
                q = PrefixQuery(ids, images, request.sampling.cache_salt) if self.policy.uses_prefix else None
                again = self.choose(d, len(ids), tried, window=False, q=q, batch=batch)  # a retry: admitted already
                if again is None:
                    return None
                p, counted = again
            tried.add(p.node_id)
            rid = request_id if attempt == 0 else f"{request_id}~{attempt}"
            ok = False
            try:
                push = await self._attempt(d, p, request, ids, rid, images, self.deadline_s(p, counted))
                ok = True
                return push
            except _Failed as f:
                attempt += 1
                failures += not f.draining
                retry = await self._after_failure(d, p, f, request_id, tried, failures)
                if retry is not True:
                    return retry
            finally:
                self._given_back(p, rid, counted, ok, batch)
                p = None

    async def alone(
        self, chosen: tuple[NodeEntry, int], request, ids: list[int], rid: str, images: Sequence[pb.ImageInput] = ()
    ) -> pb.PrefillResponse | None:
        """A request that ends at its first token (max_tokens 1), computed on P with no decode
        node: no reservation, no push. Its first (and last) message; None when P failed in a way
        another placement may mend (the caller places it again the usual way); Abort on a bad
        request."""
        p, counted = chosen
        batch = request.sampling.priority == pb.PRIORITY_BATCH
        ok = False
        call = None
        try:
            encoded = await self.encode.prepare(p, rid, images) if images and self.encode is not None else []
            call = p.stub.Prefill(
                pb.PrefillRequest(
                    request_id=rid, prompt_token_ids=ids, sampling=request.sampling, images=images, encoded=encoded
                ),
                timeout=self.deadline_s(p, counted),
            )
            first = await watched(p, call.read, call.cancel, self.cfg.heartbeat_interval_s)
            ok = first is not grpc.aio.EOF and bool(first.finish_reason)
            if not ok:
                log.warning("request %s: prefill node %s did not end it at its first token", rid, p.node_id)
                return None
            return first
        except grpc.RpcError as e:
            code = e.code()
            # a node of an earlier release wants a target: the usual way (a rolling upgrade)
            older = "TransferTarget" in (e.details() or "")
            if code == grpc.StatusCode.INVALID_ARGUMENT and not older:
                raise Abort(code, e.details() or code.name) from None
            if code == grpc.StatusCode.UNAVAILABLE and not is_draining(e):
                self.mark_dead(p)
            elif is_draining(e):
                self.registry.mark_draining(p)
            log.warning(
                "request %s: prefill on %s failed (%s: %s); placing it again", rid, p.node_id, code.name, e.details()
            )
            return None
        finally:
            if call is not None:
                call.cancel()  # a no-op once it ended
            self._given_back(p, rid, counted, ok, batch)

    def deadline_s(self, p: NodeEntry, tokens: int) -> float:
        """How long one Prefill call on p may take: --prefill-timeout plus twice the time its
        measured rate gives `tokens` (a long prompt on a slow node is work, not a hang: on a
        2-core box a 60,000-token prompt ran past a fixed 120 s). Before any rate: the timeout."""
        rate = node_rate(p, self.meter, tokens)  # at its own length: a long prompt's chunks run slower
        return self.cfg.prefill_timeout_s + (PREFILL_DEADLINE_MARGIN * tokens / rate if rate else 0.0)

    async def _attempt(
        self,
        d: NodeEntry,
        p: NodeEntry,
        request,
        ids: list[int],
        rid: str,
        images: Sequence[pb.ImageInput],
        deadline_s: float,
    ) -> Push:
        """One reservation and one Prefill call, to P's first token."""
        encoded: list[bytes] = []
        if images and self.encode is not None:  # before the lease starts; never fails the request
            encoded = await self.encode.prepare(p, rid, images)
        t0 = time.monotonic()
        try:
            await self.handshake(p, d)  # first: the lease starts when P can renew it
        except grpc.RpcError as e:
            raise _Failed(e, rid, reserved=False) from None
        try:
            target = await self.reserve(d, rid, ids, request, images)
        except grpc.RpcError as e:
            raise DecodeFailed(e) from None
        except asyncio.CancelledError:  # the client went away while D reserved: D may hold it already
            self.release_later(d, rid, "the client went away")
            raise
        reserve_s = time.monotonic() - t0
        call = None
        try:
            call = p.stub.Prefill(
                pb.PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=ids,
                    sampling=request.sampling,
                    target=target,
                    images=images,
                    encoded=encoded,
                ),
                timeout=deadline_s,
            )
            first = await watched(p, call.read, call.cancel, self.cfg.heartbeat_interval_s)  # a hung P: NodeLost
            if first is grpc.aio.EOF:  # a stream with no message: a broken node
                call.cancel()
                self.release_later(d, rid, f"prefill node {p.node_id} answered nothing")
                raise Abort(grpc.StatusCode.INTERNAL, f"prefill node {p.node_id} answered nothing")
        except grpc.RpcError as e:
            raise _Failed(e, rid, reserved=True) from None
        except asyncio.CancelledError:  # the client went away: P aborts, D's reservation goes
            if call is not None:
                call.cancel()
            self.release_later(d, rid, "the client went away")
            raise
        push = Push(p, d, rid, first, call, self.push_failed, self._spawn, self.cfg.heartbeat_interval_s)
        push.reserve_s = reserve_s
        return push

    async def _after_failure(self, d, p, f: _Failed, request_id: str, tried: set[str], failures: int):
        """After a failed attempt: True to try another prefill node, None to prefill on D;
        raises Abort when the request fails."""
        e, code = f.err, f.err.code()
        if f.draining:  # alive, finishing its own work: place this prompt elsewhere
            self.registry.mark_draining(p)
            if f.reserved:
                await self.release(d, f.rid, f"{p.node_id} is draining")
            return True if self.ready(d, tried) else None  # none other: D prefills the prompt itself
        dead = code == grpc.StatusCode.UNAVAILABLE
        if dead:
            self.mark_dead(p)
        self.forget_pair(p, d)
        if f.reserved:
            await self.release(d, f.rid, f"prefill on {p.node_id} failed: {code.name}", p.node_id if dead else "")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise Abort(code, e.details() or code.name)
        if code == grpc.StatusCode.ALREADY_EXISTS and failures < 2:  # P holds the id (a copy from a router
            tried.discard(p.node_id)  # that went away): P again, the next attempt under an id of its own
            log.info("request %s: %s holds its id still; again under another", request_id, p.node_id)
            return True
        others = self.ready(d, tried)
        log.warning(
            "request %s: prefill on %s failed (%s: %s)%s",
            request_id,
            p.node_id,
            code.name,
            e.details(),
            "; retrying on another prefill node" if failures < 2 and others else "",
        )
        if failures < 2 and others:
            return True
        if dead and not others:
            return None  # no prefill node left: D prefills the prompt itself
        raise Abort(code, f"prefill failed on {p.node_id}: {e.details() or code.name}")

    async def push_failed(self, push: Push, e: grpc.RpcError) -> None:
        """The push failed after the first token went out (its watcher task): free D's reservation
        (D's Generate(reserved) ends ABORTED); an unreachable P is marked dead and D drops its agents.
        The pair is handshaken again: P may have dropped D's agents (another router declared D dead)."""
        dead = e.code() == grpc.StatusCode.UNAVAILABLE and not is_draining(e)
        log.warning("request %s: push from %s failed (%s: %s)", push.rid, push.p.node_id, e.code().name, e.details())
        self.forget_pair(push.p, push.d)
        if dead:
            self.mark_dead(push.p)
        await self.release(
            push.d, push.rid, f"push from {push.p.node_id} failed: {e.code().name}", push.p.node_id if dead else ""
        )


class _Failed(Exception):
    """A Prefill attempt failed with a status (after D's reservation `rid` was made)."""

    def __init__(self, err: grpc.RpcError, rid: str, reserved: bool):
        super().__init__(str(err))
        self.err, self.rid, self.reserved = err, rid, reserved
        self.draining = is_draining(err)
