"""Prefix-snapshot planning (engine/cache/prefix.py): which cached prefix a waiting request starts
from, which snapshots a step saves, which pages become cached, a finished request's final state,
the state that landed on a decode node, and which waiting requests are held for an in-flight
sharer (docs/prefix-caching.md)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine.cache.block_manager import BlockManager, SlotPool
from engine.cache.inflight import hold_point
from engine.cache.prefix import ROOT_HASH, PrefixCache, PrefixHit, Snapshot, block_hash, prompt_hashes
from engine.request import Request, Status
from engine.scheduler.output import FinalSave, ScheduledRow, SchedulerOutput
from engine.step import DraftFill, SnapshotCopy

log = logging.getLogger("pdserve.scheduler")


class PrefixPlanner:
    """The scheduler's prefix-cache side; it moves no request between states."""

    def __init__(self, prefix: PrefixCache, blocks: BlockManager, slots: SlotPool, mtp: bool) -> None:
        self.prefix = prefix
        self.blocks = blocks
        self.slots = slots
        self.mtp = mtp
        # finished requests' last GDN state and partial page, held for a snapshot (take_final)
        self._final: list[FinalSave] = []
        # decode side: states that landed from a prefill node, to keep before their first step
        # changes them (take_landed): (request, its preemption count then, entry, copy)
        self._landed: list[tuple[Request, int, Snapshot, SnapshotCopy]] = []

    def hashes(self, req: Request, pages: int = 0, pending: Sequence[int] = ()) -> list[int]:
        """The chained hashes of the prompt's full pages, extended over the output tokens to at
        least `pages` pages, but only over pages whose every token is known: the output's, then
        `pending` (a step's tokens not appended yet: accepted drafts fill pages before the
        update appends them)."""
        bs, n = self.blocks.block_size, req.num_tokens
        if req.block_hashes is None:
            req.block_hashes = prompt_hashes(req.hash_prompt, bs)
        h = req.block_hashes
        while len(h) < pages and (len(h) + 1) * bs <= n + len(pending):
            j = len(h)
            ids = req.hash_ids(j * bs, (j + 1) * bs)
            if (j + 1) * bs > n:
                ids = ids + list(pending[max(j * bs, n) - n : (j + 1) * bs - n])
            h.append(block_hash(h[-1] if j else ROOT_HASH, ids))
        return h

    def lookup(self, req: Request) -> PrefixHit | None:
        """The cached prefix a waiting request can start from (with prompt logprobs, only one
        whose snapshot keeps the logprobs of the tokens it skips, `PromptLogprobs`)."""
        limit = min(len(req.prompt_token_ids), req.num_tokens - 1)
        return self.prefix.lookup(req.hash_prompt, self.hashes(req), limit, req.params.prompt_logprobs)

    def held(self, req: Request, hit: int, running: Sequence[Request], waiting: Sequence[Request] = ()) -> bool:
        """Whether `req` (cached hit: `hit` tokens) waits for a snapshot that a running request
        computing the same prefix saves at a later step (engine/cache/inflight.py); counts each
        request held once. waiting: the queue (those behind `req` may wait with it)."""
        if not running:
            return False
        limit = min(len(req.prompt_token_ids), req.num_tokens - 1)
        bs = self.blocks.block_size
        hold = hold_point(req, hit, limit, running, self.prefix.interval, bs, self.hashes, waiting)
        if hold is None:
            return False
        if not req.held_back:
            req.held_back = True
            self.prefix.stats.held += 1
            log.debug(
                "request %s waits for %s's snapshot at %d tokens (cached now: %d)",
                req.request_id,
                hold.sharer.request_id,
                hold.num_tokens,
                hit,
            )
        return True

    def admit(self, req: Request, hit: PrefixHit | None, restores: list[tuple[Snapshot, SnapshotCopy]]) -> None:
        """A request just given its slot and pages: restore the hit's snapshot (if any) and count
        the query in the stats at its first admission."""
        p = hit.num_tokens if hit else 0
        if hit is not None:
            self._restore(req, hit, restores)
        # where the prompt departs from cached ones (its last cached full page) and where its
        # messages start: snapshots there let the next prompt that shares them resume whole
        branch = len(self.cached_pages(req)) * self.blocks.block_size
        points = self.prefix.message_points(req.prompt_token_ids) + ([branch] if branch > p else [])
        req.snapshot_points = tuple(sorted(set(points)))
        if req.num_preemptions == 0:
            self.prefix.stats.query_tokens += len(req.prompt_token_ids)
            self.prefix.stats.hit_tokens += p
            req.num_cached_tokens = p

    def _restore(self, req: Request, hit: PrefixHit, restores: list[tuple[Snapshot, SnapshotCopy]]) -> None:
        p = hit.num_tokens
        req.num_computed_tokens = p
        self.prefix.acquire(hit.snapshot)
        j = self.prefix.tail_page(p)
        page = req.block_ids[j] if j is not None else None
        restores.append((hit.snapshot, SnapshotCopy(hit.snapshot.index, self._slot(req), page, last=self._last(p))))
        k = req.params.prompt_logprobs
        cached_lps = hit.snapshot.prompt_logprobs
        if k is not None and cached_lps is not None and len(req.prompt_logprobs) < p:
            # the skipped tokens' entries, from the cache
            cached = cached_lps.entries(req.prompt_token_ids[p], k)
            req.prompt_logprobs += cached[len(req.prompt_logprobs) :]
        log.debug("request %s resumes from a cached prefix of %d tokens", req.request_id, p)

    def plan_save(
        self,
        req: Request,
        n: int,
        saves: list[tuple[Snapshot, SnapshotCopy]],
        logprob_points: list[tuple[Snapshot, Request]],
    ) -> None:
        """Snapshots at the positions this prompt chunk reaches (multiples of the interval, the
        request's `snapshot_points` and the prompt's end): the one at the chunk's end from the slot after the forward, those
        inside it from the GDN layers during the forward. A request with prompt logprobs also
        leaves them on each such snapshot, new or already kept (`logprob_points`, after the step)."""
        start, plen = req.num_computed_tokens, len(req.prompt_token_ids)
        if start >= plen:
            return
        end, step = min(start + n, plen), self.prefix.interval
        grid = range((start // step + 1) * step, end + 1, step)
        extra = [q for q in req.snapshot_points if start < q <= end]
        points = sorted(set(grid).union(extra, [plen] if end == plen else []))
        # a pool with fewer free entries than the chunk's points gives them first to the prompt's
        # end, then to its message and branch points, then to the grid from the chunk's end back:
        # what a next turn resumes from. In position order the first grid points took a short
        # pool's entries, or its cold ones, and left the prompt's end to evict another
        # conversation's final state (PrefixCache.reserve)
        ranked = points
        if len(points) > self.prefix.num_free:
            ranked = sorted(points, key=lambda p: (p != plen, p not in req.snapshot_points, -p))
        got: list[tuple[int, Snapshot]] = []
        for p in ranked:
            parent, tail = self.prefix.key_for(req.hash_prompt, self.hashes(req), p)
            cold = p != plen and p not in req.snapshot_points  # on the grid only
            s = self.prefix.reserve(parent, tail, p, cold, end=p == plen)
            if req.params.prompt_logprobs is not None:
                kept = s or self.prefix.find(parent, tail)
                if kept is not None:
                    logprob_points.append((kept, req))
            if s is not None:
                got.append((p, s))
        for p, s in sorted(got, key=lambda x: x[0]):  # in position order: the forward's points
            offset = None if p == start + n else p - start
            j = self.prefix.tail_page(p)
            page = req.block_ids[j] if j is not None else None
            saves.append((s, SnapshotCopy(s.index, self._slot(req), page, offset, self._last(p))))

    def _last(self, p: int) -> int | None:
        """MTP: the position whose hidden state a snapshot at p keeps (p - 1: the drafter's KV
        there depends on token p, which differs between the prompts sharing the prefix)."""
        return p - 1 if self.prefix.mtp else None

    @staticmethod
    def _slot(req: Request) -> int:
        assert req.slot is not None, f"request {req.request_id} has no GDN slot"
        return req.slot

    def register(self, req: Request, toks: Sequence[int] = ()) -> None:
        """Full pages whose KV is now computed become cached blocks, each with the token after it
        (`toks`: tokens just sampled, not yet appended): the prompt's and the reply's."""
        bs, plen, done = self.blocks.block_size, len(req.prompt_token_ids), req.num_computed_tokens
        full = done // bs
        if full <= req.num_registered:  # no page filled since (most decode steps)
            return
        hashes = self.hashes(req, full, toks)
        out = req.output_token_ids
        for j in range(req.num_registered, full):
            e = (j + 1) * bs
            i = e - plen  # the token after the page, in the output (then in toks) where not in the prompt
            after = req.hash_prompt[e] if e < plen else (out[i] if i < len(out) else toks[i - len(out)])
            self.blocks.register(req.block_ids[j], hashes[j], after)
        req.num_registered = max(req.num_registered, full)

    def cached_pages(self, req: Request) -> list[int]:
        """The cached pages holding the prompt's leading full pages (a decode node's reservation)."""
        pages: list[int] = []
        bs, plen = self.blocks.block_size, len(req.prompt_token_ids)
        for j, h in enumerate(self.hashes(req)):
            # MTP: the drafter's KV at a page's last position holds the token after it; the first
            # token (after a prompt that ends on a page) is not known yet, so that page travels
            e = (j + 1) * bs
            after = (req.hash_prompt[e] if e < plen else -1) if self.mtp else None
            page = self.blocks.lookup(h, after)
            if page is None:
                break
            pages.append(page)
        return pages

    def keep_landed(self, req: Request) -> None:
        """Decode side: a request whose prompt state just landed from a prefill node: reserve a
        snapshot of it at the prompt's end, copied before the request's first step changes its
        slot and tail page (`take_landed`), so that the conversation's next turn, which starts
        with this prompt, can be computed here from it (docs/prefix-caching.md "Decode nodes").
        Not with MTP: the drafter's hidden state at the prompt's last position is the prefill
        node's."""
        p = len(req.prompt_token_ids)
        if self.mtp or req.status is not Status.RUNNING or p == 0:
            return
        parent, tail = self.prefix.key_for(req.hash_prompt, self.hashes(req), p)
        s = self.prefix.reserve(parent, tail, p, end=True)
        if s is None:
            return
        j = self.prefix.tail_page(p)
        page = req.block_ids[j] if j is not None else None
        self._landed.append((req, req.num_preemptions, s, SnapshotCopy(s.index, self._slot(req), page)))

    def take_landed(self, rows: Sequence[ScheduledRow]) -> list[tuple[Snapshot, SnapshotCopy]]:
        """The landed states a step copies before its forward: those of the requests it schedules
        (one not scheduled keeps its entry for a later step; its state has not changed). A request
        no longer in its reservation's state (aborted, finished, preempted) gives its entry back."""
        if not self._landed:
            return []
        scheduled = {id(r.request) for r in rows}
        out, kept = [], []
        for item in self._landed:
            req, n, s, c = item
            if req.status is not Status.RUNNING or req.num_preemptions != n or req.slot != c.slot:
                self.prefix.discard(s)
            elif id(req) in scheduled:
                out.append((s, c))
            else:
                kept.append(item)
        self._landed = kept
        return out

    def keep_final(self, req: Request) -> None:
        """A request about to finish after a step: reserve a snapshot of its GDN state at
        num_computed_tokens (the state after its last computed token) and keep its slot and tail
        page (`PrefixCache.tail_page`) out of the release until `take_final`'s copy ran; on a
        decode node too, for a request whose prompt state came from a prefill node (its next
        turn starts with the whole of this one when the history keeps the reply). With MTP the snapshot also keeps the hidden state at its last position (the worker holds
        it from the step); at draft depth 0 the drafter may have deferred its last positions' KV
        (engine/model/mtp.py), all in the tail page: the copy's call computes them first
        (`DraftFill`), the pages before the tail held for their attention until then."""
        c, bs = req.num_computed_tokens, self.blocks.block_size
        if req.status is not Status.RUNNING or c == 0:
            return
        if self.mtp and req.received and len(req.output_token_ids) == 1:  # ended by its first token
            return  # on activation: no step ran it here, so no hidden state at its last position
        # drafts accepted past a stop token: the state holds tokens the output does not; the
        # snapshot takes the one `back` tokens earlier, from the verification's per-token states
        back = max(0, c - (req.num_tokens - 1))
        if back and not self.mtp:  # n-gram drafts: not done (its rows keep no hidden state map)
            return
        c -= back
        hashes = self.hashes(req, c // bs)
        parent, tail = self.prefix.key_for(req.hash_prompt + req.output_token_ids, hashes, c)
        # the conversation's deepest point: under pressure it goes after the grid points of the
        # prompts running now and before prompt ends, message and branch points (a next turn
        # resumes here only when its history holds the reply id for id)
        s = self.prefix.reserve(parent, tail, c, final=True)
        if s is None:
            return
        plen = len(req.prompt_token_ids)
        end = self.prefix.find(*self.prefix.key_for(req.hash_prompt, self.hashes(req), plen)) if c > plen else None
        if end is not None:  # this prompt's end, on the way to the final state: an intermediate point now
            self.prefix.supersede(end)
        j = self.prefix.tail_page(c)
        fill = None
        if self.mtp and req.spec.depth == 0 and j is not None:
            fill = DraftFill(req.request_id, req.block_ids[: j + 1])
            del req.block_ids[:j]  # the tail page goes below; all are freed by reference after the copy
        page = req.block_ids.pop(j if fill is None else 0) if j is not None else None
        self._final.append(
            FinalSave(s, SnapshotCopy(s.index, self._slot(req), page, last=self._last(c), back=back), fill)
        )
        req.slot = None

    def take_final(self) -> list[FinalSave]:
        out, self._final = self._final, []
        return out

    def end_final(self, saves: list[FinalSave], ran: bool) -> None:
        """The copy ran (the snapshots are usable) or failed (their entries are free again); the
        slots and pages go back either way."""
        for f in saves:
            (self.prefix.commit if ran else self.prefix.discard)(f.snapshot)
            self.slots.free(f.copy.slot)
            if f.fill is not None:  # the pages before the tail page, the last first (as `_release`)
                self.blocks.free(f.fill.block_ids[-2::-1])
            if f.copy.page is not None:
                self.blocks.free([f.copy.page])

    def step_ran(self, out: SchedulerOutput) -> None:
        """The step has run: its saved snapshots are usable, its restores done, and the prompt
        logprobs it computed are kept on the snapshots that asked for them."""
        for s, _ in out.saves + out.landed:
            self.prefix.commit(s)
        for s, _ in out.restores:
            self.prefix.release(s)
        for s, req in out.logprob_points:
            k = req.params.prompt_logprobs
            if k is not None:
                self.prefix.keep_prompt_logprobs(s, k, req.prompt_logprobs, req.prompt_token_ids)

    def step_failed(self, out: SchedulerOutput) -> None:
        """The step failed: its snapshot pins go back, and the entries it was to save are free
        again, never half written and visible."""
        for s, _ in out.saves + out.landed:
            self.prefix.discard(s)
        for s, _ in out.restores:
            self.prefix.release(s)
        out.saves, out.restores, out.landed = [], [], []
