"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget. Running requests go first, in admission order: a decoding
request takes 1 token, a request still in its prompt takes the next chunk. Then waiting
requests join while budget, a GDN state slot and KV pages are free and the batch is under
`max_num_seqs`. When pages run out, the most recently admitted running request is preempted:
its pages and slot are freed and it goes back to the front of the queue, to recompute its
prompt and output so far when it is admitted again.

The step is a typed `SchedulerOutput`; rows are ordered decode first (one token each, the
recurrent GDN path), then prefill chunks (the chunked path).

Speculative decoding: a decoding request's row carries up to its draft depth of drafts (n-gram
proposals, or the MTP drafts the previous step left on the request), never past max_tokens,
max_model_len or the budget, so one batch mixes plain rows, rows with k drafts and rows with
fewer. With MTP, a row that samples also gets pages for the positions its next drafts occupy
(the MTP block writes its KV there while drafting). Depth control, per request: after each
verification the accepted fraction a/d updates an exponential average (weight `depth_ema`);
under `depth_lower` the depth drops by one (not below 1), over `depth_raise` it climbs by one
(not above k). Depth 0: a row's first draft pays only when it is accepted more often than `draft_cost` (the cost
of a draft relative to a plain step), so when the same kind of average of "the first draft was
accepted" falls under it, the depth goes to 0 from any depth: the row is a plain decode row in the
same batch. After `probe_interval` such steps the request probes: depth 1 again, and both
averages take the probe's outcome alone; a failed probe returns to depth 0 with
the wait doubled (up to `probe_max`), a passed one stays at depth 1 (climbing from there as before).
The MTP drafter makes a row's next drafts in the same step, so each row carries its depth after
the step for each possible outcome (`ScheduledRow.draft_depths`, from the pure functions
`_after_record` / `_after_tick` that `_record` / `_tick` apply).

Prefix caching (engine/cache/prefix.py): a waiting request is admitted from the longest cached
prefix that has both its full pages and a GDN state snapshot; the step restores the snapshot into
its slot (and its partial page) before the forward and the request computes from there (with
prompt logprobs, only from a snapshot that keeps the skipped tokens' entries, `_lookup`). Snapshots
are taken at exact token positions (every `interval` tokens, and the prompt's end) without
cutting chunks there: a chunk takes as many tokens as the budget allows, a snapshot position at
its end is saved from the slot after the forward, and one inside it is written by the GDN layers
during the forward (`SnapshotCopy.offset`, kernels/points.py). Full pages are registered once
computed, the reply's as well as the prompt's (a page entirely below `num_computed_tokens` holds
verified KV only: the last sampled token has none yet, and rejected drafts' slots lie past it), so
a conversation's next turn shares the reply's pages too. With MTP each page is registered with
the token after it (the drafter's KV at a page's last position depends on it), and the drafter
never defers a page's last position (engine/model/mtp.py), so a full page holds the drafter's
KV too. A request that finishes (stop or length) leaves a snapshot of its final GDN state at `num_computed_tokens`
(`take_final`), saved by the executor right after the step, so a colocated next turn computes
only its new tokens (with MTP, only when the request still drafts, `_keep_final`). The scheduler frees pages by reference, so a page another request shares is
never handed out.

Requests in flight share too (engine/cache/inflight.py): a waiting request that shares a new
prefix with a running request still computing its prompt, far enough past its own hit to pay, is
held back until that request's step has committed the snapshot (`_held`, decided afresh at every
step from the running batch, so a sharer that is gone releases it); it keeps its place in the
queue, and requests behind it are admitted past it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.cache.block_manager import BlockManager, SlotPool
from engine.cache.inflight import hold_point
from engine.cache.prefix import ROOT_HASH, PrefixCache, PrefixHit, Snapshot, block_hash, prompt_hashes
from engine.config import SchedulerConfig, SpeculativeConfig
from engine.request import Request, Status
from engine.step import SnapshotCopy

log = logging.getLogger("pdserve.scheduler")


@dataclass
class ScheduledRow:
    request: Request
    num_new_tokens: int  # drafts included
    draft_token_ids: list[int] = field(default_factory=list)
    # MTP: the request's draft depth after this step, by how many of its drafts it accepts (index
    # a; one entry when it carries none), so the worker drafts for the next step what it will
    # verify and defers the MTP pass of a request whose depth is about to drop to 0
    draft_depths: tuple[int, ...] = ()

    @property
    def is_decode(self) -> bool:
        """Continues a sequence with its one pending token (plus drafts): the recurrent path."""
        return self.num_new_tokens - len(self.draft_token_ids) == 1 and self.request.num_computed_tokens > 0

    @property
    def samples(self) -> bool:
        """This row reaches the end of the known tokens, so it produces the next one."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids) == r.num_tokens


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRow]
    preempted: list[Request]
    finished_ids: list[str]  # finished since the last step (workers drop their per-request state)
    restores: list[tuple[Snapshot, SnapshotCopy]] = field(default_factory=list)  # prefix hits, pinned
    saves: list[tuple[Snapshot, SnapshotCopy]] = field(default_factory=list)  # snapshots this step writes
    # snapshots (saved now or earlier) whose prompt logprobs a request with them computes this step
    logprob_points: list[tuple[Snapshot, Request]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)


@dataclass
class FinalSave:
    """A finished request's state kept for a snapshot at its last computed token: the slot and
    the partial page (None: it ends on a page boundary) are freed once the copy ran."""

    snapshot: Snapshot
    copy: SnapshotCopy


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        blocks: BlockManager,
        slots: SlotPool,
        max_model_len: int,
        num_spec_tokens: int = 0,
        proposer: Callable[[list[int], int], list[int]] | None = None,
        spec: SpeculativeConfig | None = None,
        prefix: PrefixCache | None = None,
    ):
        self.cfg = cfg
        self.spec = spec or SpeculativeConfig(num_tokens=num_spec_tokens)
        self.num_spec_tokens = num_spec_tokens
        self.mtp = self.spec.mtp  # drafts come from the model (StepOutput.drafts), not the proposer
        self.proposer = proposer
        self.blocks = blocks
        self.slots = slots
        self.prefix = prefix
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        # finished requests' last GDN state and partial page, held for a snapshot (take_final)
        self._final: list[FinalSave] = []
        self.num_draft_tokens = 0  # drafts verified so far (speculative decoding), and accepted
        self.num_accepted_tokens = 0
        self.drafts_per_position = [0] * num_spec_tokens  # drafts verified at position i of a row
        self.accepted_per_position = [0] * num_spec_tokens  # ... and accepted there

    def max_depth(self, req: Request) -> int:
        """The most drafts a row of `req` carries: k, or the request's own num_speculative_tokens
        below it; 0 for a request that does not speculate."""
        if not req.params.speculates:
            return 0
        cap = req.params.num_speculative_tokens
        return self.num_spec_tokens if cap is None else min(cap, self.num_spec_tokens)

    def add(self, req: Request) -> None:
        req.spec_depth = self.max_depth(req)
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preempted: list[Request] = []
        restores: list[tuple[Snapshot, SnapshotCopy]] = []
        saves: list[tuple[Snapshot, SnapshotCopy]] = []
        points: list[tuple[Snapshot, Request]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._drafts(req, budget) if n == 1 and req.num_computed_tokens > 0 else []
            n += len(drafts)
            need = self.blocks.blocks_for(req.num_computed_tokens + n) - len(req.block_ids)
            while need > 0 and not self.blocks.can_allocate(need):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                if not self.running:  # alone and still does not fit: it never will
                    self.finish(req, "length")
                    log.warning("request %s needs more KV pages than the cache holds; stopped", req.request_id)
                break
            if need > 0:
                req.block_ids += self.blocks.allocate(need)
            depths = self._depths_after(req, len(drafts)) if self.mtp else ()
            self._lookahead(req, n, len(drafts), max(depths, default=0))
            self._plan_save(req, n, saves, points)
            rows.append(ScheduledRow(req, n, drafts, depths))
            budget -= n
            i += 1

        w = 0  # held requests (engine/cache/inflight.py) keep their place; those behind them go on
        while not preempted and w < len(self.waiting) and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[w]
            hit = self._lookup(req)
            p = hit.num_tokens if hit else 0
            if self._held(req, p):
                w += 1
                continue
            n = min(req.num_tokens - p, budget)
            shared = hit.pages if hit else []
            need = self.blocks.blocks_for(p + n) - len(shared)
            taken = sum(self.blocks.is_free(b) for b in shared)  # cached pages nobody used: now in use
            if not self.blocks.can_allocate(need + taken) or self.slots.num_free == 0:
                break
            del self.waiting[w]
            req.slot = self.slots.allocate()
            self.blocks.touch(shared)
            req.block_ids = shared + self.blocks.allocate(need)
            req.num_registered = len(shared)
            if hit:
                self._admit_hit(req, hit, restores)
            if self.prefix is not None and req.num_preemptions == 0:
                self.prefix.stats.query_tokens += len(req.prompt_token_ids)
                self.prefix.stats.hit_tokens += p
                req.num_cached_tokens = p
            depths = self._depths_after(req, 0) if self.mtp else ()
            self._lookahead(req, n, 0, max(depths, default=0))
            self._plan_save(req, n, saves, points)
            req.status = Status.RUNNING
            self.running.append(req)
            rows.append(ScheduledRow(req, n, [], depths))
            budget -= n

        rows.sort(key=lambda r: (not r.is_decode, r.request.slot if r.is_decode else 0))
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(rows, preempted, finished, restores, saves, points)

    # ---- prefix caching --------------------------------------------------------------------
    def _hashes(self, req: Request, pages: int = 0) -> list[int]:
        """The chained hashes of the prompt's full pages, extended over the output tokens to at
        least `pages` pages."""
        bs = self.blocks.block_size
        if req.block_hashes is None:
            req.block_hashes = prompt_hashes(req.prompt_token_ids, bs)
        h = req.block_hashes
        while len(h) < pages:
            j = len(h)
            h.append(block_hash(h[-1] if j else ROOT_HASH, req.token_ids(j * bs, (j + 1) * bs)))
        return h

    def _lookup(self, req: Request) -> PrefixHit | None:
        """The cached prefix a waiting request can start from (with prompt logprobs, only one
        whose snapshot keeps the logprobs of the tokens it skips, `PromptLogprobs`)."""
        if self.prefix is None:
            return None
        limit = min(len(req.prompt_token_ids), req.num_tokens - 1)
        return self.prefix.lookup(req.prompt_token_ids, self._hashes(req), limit, req.params.prompt_logprobs)

    def _held(self, req: Request, hit: int) -> bool:
        """Whether `req` (cached hit: `hit` tokens) waits for a snapshot that a running request
        computing the same prefix saves at a later step (engine/cache/inflight.py); counts each
        request held once."""
        if self.prefix is None or not self.running:
            return False
        limit = min(len(req.prompt_token_ids), req.num_tokens - 1)
        bs = self.blocks.block_size
        hold = hold_point(req, hit, limit, self.running, self.prefix.interval, bs, self._hashes)
        if hold is None:
            return False
        if not req.held:
            req.held = True
            self.prefix.stats.held += 1
            log.debug(
                "request %s waits for %s's snapshot at %d tokens (cached now: %d)",
                req.request_id,
                hold.sharer.request_id,
                hold.num_tokens,
                hit,
            )
        return True

    def _admit_hit(self, req: Request, hit: PrefixHit, restores: list) -> None:
        p = hit.num_tokens
        req.num_computed_tokens = p
        self.prefix.acquire(hit.snapshot)
        j = self.prefix.tail_page(p)
        page = req.block_ids[j] if j is not None else None
        restores.append((hit.snapshot, SnapshotCopy(hit.snapshot.index, req.slot, page, last=self._last(p))))
        k = req.params.prompt_logprobs
        if k is not None and len(req.prompt_logprobs) < p:  # the skipped tokens' entries, from the cache
            cached = hit.snapshot.prompt_logprobs.entries(req.prompt_token_ids[p], k)
            req.prompt_logprobs += cached[len(req.prompt_logprobs) :]
        log.debug("request %s resumes from a cached prefix of %d tokens", req.request_id, p)

    def _plan_save(self, req: Request, n: int, saves: list, logprob_points: list) -> None:
        """Snapshots at the positions this prompt chunk reaches (multiples of the interval, and
        the prompt's end): the one at the chunk's end from the slot after the forward, those
        inside it from the GDN layers during the forward. A request with prompt logprobs also
        leaves them on each such snapshot, new or already kept (`logprob_points`, after the step)."""
        start, plen = req.num_computed_tokens, len(req.prompt_token_ids)
        if self.prefix is None or start >= plen:
            return
        end, step = min(start + n, plen), self.prefix.interval
        points = list(range((start // step + 1) * step, end + 1, step))
        if end == plen and (not points or points[-1] != plen):
            points.append(plen)
        for p in points:
            parent, tail = self.prefix.key_for(req.prompt_token_ids, self._hashes(req), p)
            s = self.prefix.reserve(parent, tail, p)
            if req.params.prompt_logprobs is not None:
                kept = s or self.prefix.find(parent, tail)
                if kept is not None:
                    logprob_points.append((kept, req))
            if s is not None:
                offset = None if p == start + n else p - start
                j = self.prefix.tail_page(p)
                page = req.block_ids[j] if j is not None else None
                saves.append((s, SnapshotCopy(s.index, req.slot, page, offset, self._last(p))))

    def _last(self, p: int) -> int | None:
        """MTP: the position whose hidden state a snapshot at p keeps (p - 1: the drafter's KV
        there depends on token p, which differs between the prompts sharing the prefix)."""
        return p - 1 if self.prefix.mtp else None

    def _register(self, req: Request, toks: list[int] = ()) -> None:
        """Full pages whose KV is now computed become cached blocks, each with the token after it
        (`toks`: tokens just sampled, not yet appended): the prompt's and the reply's (module
        docstring)."""
        if self.prefix is None:
            return
        bs, plen, done = self.blocks.block_size, len(req.prompt_token_ids), req.num_computed_tokens
        full = done // bs
        hashes = self._hashes(req, full)
        for j in range(req.num_registered, full):
            e = (j + 1) * bs
            after = req.prompt_token_ids[e] if e < plen else (req.output_token_ids + list(toks))[e - plen]
            self.blocks.register(req.block_ids[j], hashes[j], after)
        req.num_registered = max(req.num_registered, full)

    def _keep_final(self, req: Request) -> None:
        """A request about to finish after a step: reserve a snapshot of its GDN state at
        num_computed_tokens (the state after its last computed token) and keep its slot and tail
        page (`PrefixCache.tail_page`) out of the release until `take_final`'s copy ran. Not for
        a request whose prompt state came from another node (a decode node needs no snapshots).
        With MTP the snapshot also keeps the hidden state at its last position (the worker holds
        it from the step), and a request whose draft depth is 0 keeps none: the drafter may have
        deferred its last positions' KV (engine/model/mtp.py), so its tail page lacks it."""
        c, bs = req.num_computed_tokens, self.blocks.block_size
        if self.prefix is None or req.received or req.status is not Status.RUNNING or c == 0:
            return
        if self.mtp and req.spec_depth == 0:
            return
        hashes = self._hashes(req, c // bs)
        parent, tail = self.prefix.key_for(req.prompt_token_ids + req.output_token_ids, hashes, c)
        s = self.prefix.reserve(parent, tail, c)
        if s is None:
            return
        j = self.prefix.tail_page(c)
        page = req.block_ids.pop(j) if j is not None else None  # freed by reference after the copy
        self._final.append(FinalSave(s, SnapshotCopy(s.index, req.slot, page, last=self._last(c))))
        req.slot = None

    def take_final(self) -> list[FinalSave]:
        """The final-state snapshots to copy now (`SnapshotCopy`s with offset None, no rows); hand
        them back with `end_final`."""
        out, self._final = self._final, []
        return out

    def end_final(self, saves: list[FinalSave], ran: bool) -> None:
        """The copy ran (the snapshots are usable) or failed (their entries are free again); the
        slots and pages go back either way."""
        for f in saves:
            (self.prefix.commit if ran else self.prefix.discard)(f.snapshot)
            self.slots.free(f.copy.slot)
            if f.copy.page is not None:
                self.blocks.free([f.copy.page])

    def _lookahead(self, req: Request, n: int, num_drafts: int, depth: int) -> None:
        """With MTP, a row that samples also takes pages, while free ones remain, for the positions
        its next drafts occupy (capped at max_model_len); it never preempts for them: without
        them the worker drafts fewer tokens."""
        end = req.num_computed_tokens + n
        if not self.mtp or end - num_drafts < req.num_tokens:
            return
        end = min(end + max(depth - 1, 0), self.max_model_len)
        extra = min(self.blocks.blocks_for(end) - len(req.block_ids), self.blocks.num_free)
        if extra > 0:
            req.block_ids += self.blocks.allocate(extra)

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request, never past its depth, max_tokens, max_model_len
        or the budget."""
        if not self.num_spec_tokens or (self.proposer is None and not self.mtp):
            return []
        room = min(
            req.spec_depth,
            budget - 1,
            req.params.max_tokens - len(req.output_token_ids) - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        if room <= 0:
            return []
        if self.mtp:
            return req.draft_token_ids[:room]
        return list(self.proposer(req.prompt_token_ids + req.output_token_ids, room))[:room]

    def _record(self, req: Request, proposed: int, accepted: int) -> None:
        """Counters per draft position, and the request's depth control (module docstring)."""
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(proposed):
            self.drafts_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted
        self._apply(req, self._after_record(req, proposed, accepted))

    def _after_record(self, req: Request, proposed: int, accepted: int) -> dict:
        """The request's depth-control fields after verifying `proposed` drafts of which
        `accepted` held (a pure function of its fields: `_depths_after` asks it ahead)."""
        sp, w = self.spec, self.spec.depth_ema
        probe = req.spec_probing
        w = 1.0 if probe else w  # the text may have changed since the request stopped drafting: the probe alone counts
        a = (1 - w) * req.spec_acceptance + w * accepted / proposed
        first = (1 - w) * req.spec_first + w * (accepted > 0)
        out = dict(spec_probing=False, spec_acceptance=a, spec_first=first)
        depth = req.spec_depth
        if first < sp.draft_cost:
            out["spec_gap"] = min(2 * req.spec_gap, sp.probe_max) if probe else sp.probe_interval
            out["spec_wait"] = out["spec_gap"]
            depth = 0
        elif a < sp.depth_lower and depth > 1:
            depth -= 1
        elif a > sp.depth_raise and depth < self.max_depth(req) and not probe:
            depth += 1
        out["spec_depth"] = depth
        return out

    def _tick(self, req: Request) -> None:
        """A sampling step of a request at depth 0 that could draft: count down to its next probe."""
        self._apply(req, self._after_tick(req))

    def _after_tick(self, req: Request) -> dict:
        if req.spec_depth or not self.max_depth(req):
            return {}
        if req.spec_wait - 1 <= 0:
            return dict(spec_wait=req.spec_wait - 1, spec_depth=1, spec_probing=True)
        return dict(spec_wait=req.spec_wait - 1)

    @staticmethod
    def _apply(req: Request, fields: dict) -> None:
        for name, v in fields.items():
            setattr(req, name, v)

    def _depths_after(self, req: Request, num_drafts: int) -> tuple[int, ...]:
        """The request's depth after this step (ScheduledRow.draft_depths), for each number of
        accepted drafts."""
        if not num_drafts:
            return (self._after_tick(req).get("spec_depth", req.spec_depth),)
        return tuple(self._after_record(req, num_drafts, a)["spec_depth"] for a in range(num_drafts + 1))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.draft_token_ids = []
        self._release(req)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        log.info("preempted %s (recompute %d tokens later)", req.request_id, req.num_tokens)

    def _release(self, req: Request) -> None:
        if req.block_ids:
            self.blocks.free(req.block_ids[::-1])  # a chain's last pages are evicted first
            req.block_ids = []
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None

    # ---- disaggregation: memory held outside the running batch -------------------------
    def reserve(self, req: Request) -> bool:
        """Pages for the prompt and the first decoded token, and a GDN slot, or False. The
        prompt's leading full pages this node has cached are shared (by reference), not
        allocated: `req.num_cached_blocks` of them, which the transfer skips. No snapshot is
        needed: the GDN state always travels."""
        shared = self._cached_pages(req)
        need = self.blocks.blocks_for(req.num_tokens + 1) - len(shared)
        taken = sum(self.blocks.is_free(b) for b in shared)  # cached pages nobody used: now in use
        if not self.blocks.can_allocate(need + taken) or self.slots.num_free == 0:
            return False
        self.blocks.touch(shared)
        req.block_ids = shared + self.blocks.allocate(need)
        req.num_registered = req.num_cached_blocks = len(shared)
        req.slot = self.slots.allocate()
        req.status = Status.RESERVED
        req.received = True
        if self.prefix is not None:  # the shared pages are hits: the transfer skips them
            self.prefix.stats.query_tokens += len(req.prompt_token_ids)
            self.prefix.stats.hit_tokens += len(shared) * self.blocks.block_size
        return True

    def _cached_pages(self, req: Request) -> list[int]:
        """The cached pages holding the prompt's leading full pages (none without a prefix cache)."""
        if self.prefix is None:
            return []
        pages, bs, plen = [], self.blocks.block_size, len(req.prompt_token_ids)
        for j, h in enumerate(self._hashes(req)):
            # MTP: the drafter's KV at a page's last position holds the token after it; the first
            # token (after a prompt that ends on a page) is not known yet, so that page travels
            e = (j + 1) * bs
            after = (req.prompt_token_ids[e] if e < plen else -1) if self.mtp else None
            page = self.blocks.lookup(h, after)
            if page is None:
                break
            pages.append(page)
        return pages

    def activate(self, req: Request, first_token: int, eos: tuple[int, ...], drafts: list[int] = ()) -> None:
        """The prompt's state has landed in the reservation: decode from the first token on
        (with the drafts the prefill side's MTP block proposed, when there are any)."""
        assert req.status is Status.RESERVED, req.status
        req.num_computed_tokens = len(req.prompt_token_ids)
        req.spec_depth = self.max_depth(req)
        req.draft_token_ids = list(drafts)[: req.spec_depth] if self.mtp else []
        req.status = Status.RUNNING
        self.running.append(req)
        self._emit(req, [first_token], eos)

    def _hold(self, req: Request) -> None:
        """Prefill side: keep the prompt's pages and slot for the transfer (pages taken only for
        the MTP drafts' positions go back now)."""
        keep = self.blocks.blocks_for(len(req.prompt_token_ids))
        if len(req.block_ids) > keep:
            self.blocks.free(req.block_ids[keep:])
            del req.block_ids[keep:]
        self.running.remove(req)
        req.status = Status.HELD
        req.finish_reason = "prefilled"
        req.finish_time = time.monotonic()

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        self._finished_ids.append(req.request_id)

    def abandon(self, out: SchedulerOutput) -> None:
        """The step failed (the executor raised): its snapshot pins go back, and the entries it
        was to save are free again, never half written and visible."""
        if self.prefix is None:
            return
        for s, _ in out.saves:
            self.prefix.discard(s)
        for s, _ in out.restores:
            self.prefix.release(s)
        out.saves, out.restores = [], []

    def update(
        self, out: SchedulerOutput, sampled: dict[str, list[int]], eos: tuple[int, ...], drafts: dict | None = None
    ) -> list[Request]:
        """Advance every scheduled row by its computed tokens; append the emitted tokens (one, or
        the accepted drafts plus one); finish what stops. Returns requests that got tokens or finished."""
        touched = []
        if self.prefix is not None:  # the step has run: saved snapshots are usable, restores done
            for s, _ in out.saves:
                self.prefix.commit(s)
            for s, _ in out.restores:
                self.prefix.release(s)
            for s, req in out.logprob_points:  # the step's prompt logprobs are on the request now
                self.prefix.keep_prompt_logprobs(
                    s, req.params.prompt_logprobs, req.prompt_logprobs, req.prompt_token_ids
                )
        for row in out.rows:
            req = row.request
            if req.status is not Status.RUNNING:
                continue
            if not row.samples:
                req.num_computed_tokens += row.num_new_tokens
                self._register(req)
                continue
            toks = sampled[req.request_id]
            if row.draft_token_ids:
                self._record(req, len(row.draft_token_ids), len(toks) - 1)
            else:
                self._tick(req)
            if self.mtp:
                req.draft_token_ids = drafts.get(req.request_id, []) if drafts else []
            # the pending token and the accepted drafts are now in the cache
            req.num_computed_tokens += row.num_new_tokens - len(row.draft_token_ids) + len(toks) - 1
            self._register(req, toks)
            touched.append(req)
            self._emit(req, toks, eos)
            if req.prefill_only and req.status is Status.RUNNING:
                self._hold(req)
        return touched

    def _emit(self, req: Request, toks: list[int], eos: tuple[int, ...]) -> None:
        """Append tokens one by one, finishing on a stop token, EOS, max_tokens or max_model_len."""
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        p = req.params
        for tok in toks:
            req.output_token_ids.append(tok)
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in eos):
                reason = "stop"
            elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            else:
                continue
            self._keep_final(req)
            self.finish(req, reason)
            return
