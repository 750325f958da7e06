"""The Scheduler: continuous batching with a token budget and chunked prefill, preemption by
recompute (newest first), draft rows at each request's depth, and the disaggregated states (a
prefill side's HELD requests, a decode side's RESERVED ones); every state change goes through
`Request.move`."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from engine.cache.block_manager import BlockManager, SlotPool
from engine.cache.prefix import PrefixCache
from engine.config import SchedulerConfig, SpeculativeConfig
from engine.request import Request, Status, TransitionError
from engine.scheduler import priority, spec_depth
from engine.scheduler.output import FinalSave, ScheduledRow, SchedulerOutput, StepPlan
from engine.scheduler.prefix_plan import PrefixPlanner
from engine.scheduler.priority import BATCH, INTERACTIVE
from engine.scheduler.steady import SteadyRows

log = logging.getLogger("pdserve.scheduler")

Proposer = Callable[[list[int], int], list[int]]


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        blocks: BlockManager,
        slots: SlotPool,
        max_model_len: int,
        num_spec_tokens: int = 0,
        proposer: Proposer | None = None,
        spec: SpeculativeConfig | None = None,
        prefix: PrefixCache | None = None,
    ) -> None:
        self.cfg = cfg
        self.spec = spec or SpeculativeConfig(num_tokens=num_spec_tokens)
        self.num_spec_tokens = num_spec_tokens
        self.mtp = self.spec.mtp  # drafts come from the model (StepOutput.drafts), not the proposer
        self.proposer = proposer
        self.blocks = blocks
        self.slots = slots
        self.prefix = prefix
        self.plan = PrefixPlanner(prefix, blocks, slots, self.mtp) if prefix is not None else None
        self.max_model_len = max_model_len
        # where a request's context stops: max_model_len, or where the cache holds fewer tokens, its
        # KV pages' tokens and the pending one (it needs no page): "length" and a warning (`_emit`)
        self.context_len = min(max_model_len, blocks.num_blocks * blocks.block_size + 1)
        if self.context_len < max_model_len:  # vLLM refuses to start here; the engine serves shorter contexts
            log.warning(
                "max_model_len %d is more than the KV cache holds (%d tokens): a request stops (length) where its "
                "context fills the cache; raise --kv-cache-memory or lower --max-model-len",
                max_model_len,
                self.context_len - 1,
            )
        self.waiting: deque[Request] = deque()  # both in class order (engine/scheduler/priority.py)
        self.running: list[Request] = []
        self.classes = priority.Classes()
        self._finished_ids: list[str] = []
        # every request `finish` ended, for the engine to report and let go (EngineCore.step
        # empties it each step): not a scan of every request the engine holds
        self.ended: list[Request] = []
        self.ended_total = 0  # requests finished or aborted since start (NodeInfo.requests_ended)
        self.preemptions_total = 0  # requests preempted since start (vllm:num_preemptions)
        self.num_draft_tokens = 0  # drafts verified so far (speculative decoding), and accepted
        self.num_accepted_tokens = 0
        self.drafts_per_position = [0] * num_spec_tokens  # drafts verified at position i of a row
        self.accepted_per_position = [0] * num_spec_tokens  # ... and accepted there
        # the short-prompt cap (SchedulerConfig.short_step_tokens) holds: a decode node sets it
        # while the router reports a prefill pool ready for it (without one, every prompt is its own)
        self.short_active = True
        self.steady = SteadyRows()  # the last step's rows, where all were plain decode rows

    def add(self, req: Request) -> None:
        req.spec = spec_depth.started(req.spec, req.params, self.num_spec_tokens)
        priority.insert(self.waiting, req)
        self.classes.arrived(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Running rows, then waiting requests, class by class (engine/scheduler/priority.py):
        interactive ones first; batch prompt chunks get `priority.batch_allowance` tokens, none in
        a step that computes an interactive prompt chunk."""
        allowance = self.classes.batch_allowance(self.running, self.waiting, self.cfg)
        steady = self._steady(allowance)
        if steady is not None:
            return steady
        plan = self._new_plan()
        i = 0
        for cls in (INTERACTIVE, BATCH):
            if cls == BATCH:
                plan.batch_left = 0 if plan.urgent() else allowance
            i = self._running_rows(plan, i, cls)
            i = self._admit_waiting(plan, i, cls)
        rows = plan.rows
        rows.sort(key=lambda r: (not r.is_decode, (r.request.slot or 0) if r.is_decode else 0))
        finished, self._finished_ids = self._finished_ids, []
        landed = self.plan.take_landed(rows) if self.plan is not None else []
        plain = rows and plan.plain == len(rows) and not (plan.preempted or plan.restores or plan.saves or plan.points)
        self.steady.keep(self.running, rows if plain else None)
        return SchedulerOutput(rows, plan.preempted, finished, plan.restores, plan.saves, landed, plan.points)

    def _steady(self, allowance: int) -> SchedulerOutput | None:
        """The last step's rows again where nothing else would be planned (engine/scheduler/steady.py);
        allowance: the step's `batch_allowance`."""
        rows = self.steady.take(self.running, self.waiting, self.cfg, self.blocks, lambda: self._could_admit(allowance))
        if rows is None:
            return None
        finished, self._finished_ids = self._finished_ids, []
        landed = self.plan.take_landed(rows) if self.plan is not None else []
        return SchedulerOutput(rows, [], finished, [], [], landed, [], steady=True)

    def _new_plan(self) -> StepPlan:
        short = self.cfg.short_step_tokens if self.cfg.short_prompt_tokens and self.short_active else 0
        return StepPlan(self.cfg.max_num_batched_tokens, short)

    def _could_admit(self, allowance: int) -> bool:
        """Whether `schedule` would start a waiting request in a step whose every running request
        is a plain decode row with its page (one token each): `_admit_waiting` asked without
        admitting, class by class, with the budget the running rows leave it (`allowance`: the
        step's `batch_allowance`)."""
        plan = self._new_plan()
        i = 0
        for cls in (INTERACTIVE, BATCH):
            while i < len(self.running) and self.running[i].params.priority == cls:
                i += 1
            plan.budget = self.cfg.max_num_batched_tokens - i
            plan.batch_left = allowance
            if self._admit_waiting(plan, i, cls, dry=True) > i:
                return True
        return False

    def _running_rows(self, plan: StepPlan, i: int, cls: int) -> int:
        """Schedule the running requests of class `cls` from index i (the running list is kept in
        class order); returns the index after them."""
        # a row past its prompt with one token left, no drafts and room for it in its pages takes
        # no decision below: planned at once (most rows of a decode step)
        plain = not self.mtp and not (self.num_spec_tokens and self.proposer is not None)
        bs = self.blocks.block_size
        while i < len(self.running) and plan.budget > 0 and self.running[i].params.priority == cls:
            req = self.running[i]
            done = req.num_computed_tokens
            left = req.num_tokens - done
            if plain and left == 1 and done >= len(req.prompt_token_ids) and len(req.block_ids) * bs > done:
                plan.rows.append(ScheduledRow(req, 1))
                plan.budget -= 1
                plan.plain += 1
                i += 1
                continue
            n = min(left, plan.budget)
            if cls == BATCH and left > 1:  # a batch prompt chunk: within the allowance
                n = min(n, plan.batch_left)
                if n <= 0:
                    i += 1
                    continue
            if req.short and left > 1 and plan.short_cap:
                n = self._short_share(plan, n)
                if n <= 0:
                    i += 1
                    continue
            drafts = self._drafts(req, plan.budget) if left == 1 and req.num_computed_tokens > 0 else []
            n += len(drafts)
            need = self.blocks.blocks_for(req.num_computed_tokens + n) - len(req.block_ids)
            while need > 0 and not self.blocks.can_allocate(need):
                victim = self._victim(i)  # never a row planned already
                if victim.no_pixels:  # cannot recompute its prompt here (docs/images.md)
                    self.finish(victim, "abort")
                    log.warning("request %s gave its memory up: its images are not on this node", victim.request_id)
                else:
                    self._preempt(victim)
                    plan.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:  # gave its own pages up (a request never outgrows the
                plan.budget = 0  # cache, `context_len`): the rest are held outside the batch, by a decode
                break  # node's reservations or a prefill node's holds; it recomputes once they are free
            if need > 0:
                req.block_ids += self.blocks.allocate(need)
            self._plan_row(plan, req, n, drafts)
            if plain and left == 1 and done >= len(req.prompt_token_ids):  # a plain row that took a page
                plan.plain += 1
            if cls == BATCH and left > 1:
                plan.batch_left -= n
            i += 1
        if plan.budget <= 0:  # out of budget (or a request that does not fit): the rest waits
            return len(self.running)
        while i < len(self.running) and self.running[i].params.priority == cls:
            i += 1
        return i

    def _admit_waiting(self, plan: StepPlan, i: int, cls: int, dry: bool = False) -> int:
        """Admit waiting requests of class `cls` into the running list at index i (the end of
        their class there); returns the index after them. dry: admit none, return i + 1 at the
        first that would start (`_could_admit`)."""
        w = 0  # held requests (engine/cache/inflight.py) keep their place; those behind them go on
        while (
            not plan.preempted
            and w < len(self.waiting)
            and plan.budget > 0
            and len(self.running) < self.cfg.max_num_seqs
        ):
            req = self.waiting[w]
            if req.params.priority != cls:
                if req.params.priority > cls:
                    break  # the waiting queue is in class order too
                w += 1
                continue
            hit = self.plan.lookup(req) if self.plan is not None else None
            p = hit.num_tokens if hit else 0
            # dry (`_could_admit`): every running request decodes, none computes a prompt to wait for
            if not dry and self.plan is not None and self.plan.held(req, p, self.running, self.waiting):
                w += 1
                continue
            n = min(req.num_tokens - p, plan.budget)
            if cls == BATCH:
                n = min(n, plan.batch_left)
                if n <= 0:
                    break
            short = plan.short_cap > 0 and req.num_tokens - p < self.cfg.short_prompt_tokens
            if short:
                n = self._short_share(plan, n)
                if n <= 0:  # the step has its share of short prompts: longer ones behind may go
                    w += 1
                    continue
            shared = hit.pages if hit else []
            need = self.blocks.blocks_for(self._admit_upto(req, p + n)) - len(shared)
            taken = sum(self.blocks.is_free(b) for b in shared)  # cached pages nobody used: now in use
            if not self.blocks.can_allocate(need + taken) or self.slots.num_free == 0:
                break
            if dry:
                return i + 1
            del self.waiting[w]
            req.slot = self.slots.allocate()
            self.blocks.touch(shared)
            req.block_ids = shared + self.blocks.allocate(need)
            req.num_registered = len(shared)
            if self.plan is not None:
                self.plan.admit(req, hit, plan.restores)
            req.move(Status.RUNNING)
            req.short = short
            self.running.insert(i, req)
            i += 1
            self._plan_row(plan, req, n, [])
            if cls == BATCH:
                plan.batch_left -= n
        return i

    @staticmethod
    def _short_share(plan: StepPlan, n: int) -> int:
        """The tokens a short prompt's chunk of n gets in this step: all of them within what short
        prompts have left, none when they do not fit (it waits a step: cut, it would need one
        more), unless none has run yet in the step (a prompt longer than the cap is chunked)."""
        if n > plan.short_left and plan.short_left < plan.short_cap:
            return 0
        n = min(n, plan.short_left)
        plan.short_left -= n
        return n

    def _plan_row(self, plan: StepPlan, req: Request, n: int, drafts: list[int]) -> None:
        depths = self._depths_after(req, len(drafts)) if self.mtp else ()
        self._lookahead(req, n, len(drafts), max(depths, default=0))
        if self.plan is not None:
            self.plan.plan_save(req, n, plan.saves, plan.points)
        plan.rows.append(ScheduledRow(req, n, drafts, depths))
        plan.budget -= n

    def _admit_upto(self, req: Request, end: int) -> int:
        """The tokens a request takes pages for as it starts: its first chunk's, or a prefill-only
        request's whole prompt (it holds them all for its transfer anyway, and a transfer that
        streams each chunk's pages names every page when it opens), unless the prompt needs more
        pages than the cache has (it then stops for lack of pages, as any request)."""
        if req.prefill_only and self.blocks.blocks_for(req.num_tokens) <= self.blocks.num_blocks:
            return req.num_tokens
        return end

    def _lookahead(self, req: Request, n: int, num_drafts: int, depth: int) -> None:
        """With MTP, a row that samples also takes pages, while free ones remain, for the positions
        its next drafts occupy (capped at `context_len`); it never preempts for them: without
        them the worker drafts fewer tokens."""
        end = req.num_computed_tokens + n
        if not self.mtp or end - num_drafts < req.num_tokens:
            return
        end = min(end + max(depth - 1, 0), self.context_len)
        extra = min(self.blocks.blocks_for(end) - len(req.block_ids), self.blocks.num_free)
        if extra > 0:
            req.block_ids += self.blocks.allocate(extra)

    def _victim(self, i: int) -> Request:
        """The request that gives its memory up, among those not yet scheduled this step (from
        running[i]): the newest of the lowest class that can recompute its prompt, else the last."""
        return next((r for r in reversed(self.running[i:]) if not r.no_pixels), self.running[-1])

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.draft_token_ids = []
        self._release(req)
        req.move(Status.PREEMPTED)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.preemptions_total += 1
        priority.insert(self.waiting, req, front=True)
        log.info("preempted %s (recompute %d tokens later)", req.request_id, req.num_tokens)

    def _release(self, req: Request) -> None:
        if req.block_ids:
            self.blocks.free(req.block_ids[::-1])  # a chain's last pages are evicted first
            req.block_ids = []
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None

    def finish(self, req: Request, reason: str) -> None:
        """Stop a request for `reason` ("abort": ABORTED, anything else: FINISHED) and free its memory."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status.is_queued and req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.move(Status.ABORTED if reason == "abort" else Status.FINISHED)
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        self._finished_ids.append(req.request_id)
        self.ended.append(req)
        self.ended_total += 1
        req.ended_seq = self.ended_total

    # ---- speculative decoding: drafts and the depth policy (spec_depth.py) -------------------
    def _drafts(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request, never past its depth, max_tokens, `context_len`
        or the budget."""
        c = req.params.constraint  # one whose matcher cannot roll back a rejected draft: none
        if not self.num_spec_tokens or (self.proposer is None and not self.mtp) or (c and not c.drafts_ok):
            return []
        room = min(
            req.spec.depth,
            budget - 1,
            req.params.max_tokens - len(req.output_token_ids) - 1,
            self.context_len - req.num_tokens - 1,
        )
        if room <= 0:
            return []
        if self.mtp:
            return req.draft_token_ids[:room]
        assert self.proposer is not None
        return list(self.proposer(req.prompt_token_ids + req.output_token_ids, room))[:room]

    def _record(self, req: Request, proposed: int, accepted: int) -> None:
        """Counters per draft position, and the request's next depth."""
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(proposed):
            self.drafts_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted
        req.spec = spec_depth.after_verify(req.spec, self.spec, proposed, accepted)

    def _tick(self, req: Request) -> None:
        """A sampling step without drafts: at depth 0, count down to the next probe."""
        req.spec = spec_depth.after_plain(req.spec)

    def _depths_after(self, req: Request, num_drafts: int) -> tuple[int, ...]:
        return spec_depth.depths_after(req.spec, self.spec, num_drafts)

    # ---- disaggregation: memory held outside the running batch ------------------------------
    def reserve(self, req: Request) -> bool:
        """Decode side: pages for the prompt and the first decoded token, and a GDN slot, or False.
        The prompt's leading full pages this node has cached are shared (by reference), not allocated:
        `req.num_cached_blocks` of them, which the transfer skips (no snapshot: the state travels)."""
        shared = self.plan.cached_pages(req) if self.plan is not None else []
        need = self.blocks.blocks_for(req.num_tokens + 1) - len(shared)
        taken = sum(self.blocks.is_free(b) for b in shared)  # cached pages nobody used: now in use
        if not self.blocks.can_allocate(need + taken) or self.slots.num_free == 0:
            return False
        self.blocks.touch(shared)
        req.block_ids = shared + self.blocks.allocate(need)
        req.num_registered = req.num_cached_blocks = len(shared)
        req.slot = self.slots.allocate()
        req.move(Status.RESERVED)
        req.received = True
        req.num_cached_tokens = len(shared) * self.blocks.block_size  # hits, which the transfer skips (its log line)
        if self.prefix is not None:
            self.prefix.stats.query_tokens += len(req.prompt_token_ids)
            self.prefix.stats.hit_tokens += req.num_cached_tokens
        return True

    def activate(self, req: Request, first_token: int, eos: tuple[int, ...], drafts: Sequence[int] = ()) -> None:
        """Decode side: the prompt's state has landed in the reservation: decode from the first
        token on (with the drafts the prefill side's MTP block proposed, when there are any)."""
        if req.status is not Status.RESERVED:
            raise TransitionError(f"request {req.request_id!r} is {req.status.value}: only a reserved one activates")
        req.move(Status.RUNNING)
        req.num_computed_tokens = len(req.prompt_token_ids)
        req.spec = spec_depth.started(req.spec, req.params, self.num_spec_tokens)
        req.draft_token_ids = list(drafts)[: req.spec.depth] if self.mtp else []
        priority.insert(self.running, req)
        self._emit(req, [first_token], eos)
        if self.plan is not None:
            self.plan.keep_landed(req)

    def _hold(self, req: Request) -> None:
        """Prefill side: keep the prompt's pages and slot for the transfer (pages taken only for
        the MTP drafts' positions go back now)."""
        keep = self.blocks.blocks_for(len(req.prompt_token_ids))
        if len(req.block_ids) > keep:
            self.blocks.free(req.block_ids[keep:])
            del req.block_ids[keep:]
        self.running.remove(req)
        req.move(Status.HELD)
        req.finish_reason = "prefilled"
        req.finish_time = time.monotonic()

    # ---- after a step ------------------------------------------------------------------------
    def take_final(self) -> list[FinalSave]:
        """The final-state snapshots to copy now (`SnapshotCopy`s with offset None, no rows); hand
        them back with `end_final`."""
        return self.plan.take_final() if self.plan is not None else []

    def end_final(self, saves: list[FinalSave], ran: bool) -> None:
        if self.plan is not None:
            self.plan.end_final(saves, ran)

    def abandon(self, out: SchedulerOutput) -> None:
        """The step failed (the executor raised): its snapshot pins go back, and the entries it
        was to save are free again, never half written and visible."""
        if self.plan is not None:
            self.plan.step_failed(out)

    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, list[int]],
        eos: tuple[int, ...],
        drafts: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Advance every scheduled row by its computed tokens; append the emitted tokens (one, or
        the accepted drafts plus one); finish what stops. Returns requests that got tokens or finished."""
        touched: list[Request] = []
        if self.plan is not None:
            self.plan.step_ran(out)
        bs = self.blocks.block_size
        for row in out.rows:
            req = row.request
            if req.status is not Status.RUNNING:
                continue
            if not row.samples:
                req.num_computed_tokens += row.num_new_tokens
                if self.plan is not None:
                    self.plan.register(req)
                continue
            toks = sampled[req.request_id]
            if row.draft_token_ids:
                self._record(req, len(row.draft_token_ids), len(toks) - 1)
            elif self.num_spec_tokens:  # without speculation the depth record never moves
                self._tick(req)
            if self.mtp:
                req.draft_token_ids = drafts.get(req.request_id, []) if drafts else []
            # the pending token and the accepted drafts are now in the cache
            req.num_computed_tokens += row.num_new_tokens - len(row.draft_token_ids) + len(toks) - 1
            if self.plan is not None and req.num_computed_tokens // bs > req.num_registered:  # a page filled
                self.plan.register(req, toks)
            touched.append(req)
            self._emit(req, toks, eos)
            if req.prefill_only and req.status is Status.RUNNING:
                self._hold(req)
        return touched

    def _emit(self, req: Request, toks: list[int], eos: tuple[int, ...]) -> None:
        """Append tokens one by one, finishing on a stop token, EOS, max_tokens or max_model_len (or
        the cache's tokens where they are fewer: `context_len`)."""
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        p, out = req.params, req.output_token_ids
        for tok in toks:
            out.append(tok)
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in eos):
                reason = "stop"
            elif len(out) >= p.max_tokens or len(req.prompt_token_ids) + len(out) >= self.context_len:
                reason = "length"
                if len(out) < p.max_tokens and len(req.prompt_token_ids) + len(out) < self.max_model_len:
                    log.warning(
                        "request %s stopped (length) after %d tokens: its context fills the KV cache's %d tokens "
                        "before max_model_len %d; raise --kv-cache-memory or lower --max-model-len",
                        req.request_id,
                        len(out),
                        self.context_len - 1,
                        self.max_model_len,
                    )
            else:
                continue
            if self.plan is not None:
                self.plan.keep_final(req)
            self.finish(req, reason)
            return
