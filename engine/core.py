"""EngineCore: validates requests, runs scheduler steps on the executor, reports outputs.

Used by `LLM` (offline batches) and by the serving nodes (one request at a time, streamed).
A bad request is refused with ValueError before it touches the scheduler, so the requests
already in flight carry on.
"""

from __future__ import annotations

import itertools
import logging
import time

from engine.cache.block_manager import BlockManager, SlotPool
from engine.cache.prefix import PrefixCache
from engine.config import EngineConfig
from engine.executor import make_executor
from engine.outputs import RequestOutput
from engine.request import Request, Status
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec_decode import NgramProposer
from engine.step import RowInput, StepInput

log = logging.getLogger("pdserve.engine")


class EngineCore:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        t0 = time.perf_counter()
        self.executor = make_executor(cfg)
        self.capacity = self.executor.capacity
        self.blocks = BlockManager(self.capacity.num_blocks, cfg.cache.block_size)
        self.slots = SlotPool(self.capacity.num_state_slots)
        self.prefix = self._prefix_cache()
        spec = cfg.speculative
        self.proposer = NgramProposer(spec.ngram_min, spec.ngram_max) if spec.num_tokens and not spec.mtp else None
        self.scheduler = Scheduler(
            cfg.scheduler, self.blocks, self.slots, cfg.max_model_len, spec.num_tokens, self._propose, spec, self.prefix
        )
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        # (SchedulerOutput) -> None, run after scheduling and before the forward pass of every step
        self.on_schedule = None
        log.info(
            "engine ready in %.1f s: %s, tp=%d, %s",
            time.perf_counter() - t0,
            cfg.model.architecture,
            cfg.parallel.tensor_parallel_size,
            self.capacity.summary(),
        )

    def _prefix_cache(self) -> PrefixCache | None:
        c = self.cfg.cache
        if not c.enable_prefix_caching:
            return None
        if self.capacity.num_snapshots == 0:
            log.warning(
                "prefix caching is off: prefix_snapshot_memory=%.3g of the cache holds no snapshot", c.snapshot_fraction
            )
            return None
        return PrefixCache(self.blocks, self.capacity.num_snapshots, c.snapshot_interval, self.cfg.speculative.mtp)

    def _propose(self, tokens: list[int], k: int) -> list[int]:
        return self.proposer(tokens, k) if self.proposer is not None else []

    # ---- requests -------------------------------------------------------------------
    def validate(self, prompt_token_ids, params) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams (got {type(params).__name__})")
        if not isinstance(prompt_token_ids, (list, tuple)) or len(prompt_token_ids) == 0:
            raise ValueError("empty prompt: give at least one token")
        vocab = self.cfg.model.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} out of range [0, {vocab}) for this model's vocabulary")
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token id(s) {bad[:5]} out of range [0, {vocab}) for this model's vocabulary")
        k, cap = self.cfg.speculative.num_tokens, params.num_speculative_tokens
        if cap is not None and cap > k:
            raise ValueError(
                f"num_speculative_tokens {cap} exceeds this server's {k} (--num-speculative-tokens): "
                f"ask for at most {k}" + (" (speculative decoding is off)" if k == 0 else "")
            )
        n, limit = len(prompt_token_ids), self.cfg.max_model_len
        if n >= limit:
            raise ValueError(f"prompt of {n} tokens leaves no room to generate: max_model_len is {limit}")
        need = self.blocks.blocks_for(n + 1)
        if need > self.capacity.num_blocks:
            raise ValueError(
                f"prompt of {n} tokens needs {need} KV blocks but the cache holds {self.capacity.num_blocks}; "
                "raise kv_cache_memory"
            )

    def _new(self, prompt_token_ids, params, request_id, **kw) -> Request:
        self.validate(prompt_token_ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in flight")
        return Request(rid, list(prompt_token_ids), params, **kw)

    def add_request(
        self,
        prompt_token_ids,
        params: SamplingParams,
        request_id: str | None = None,
        want_logits: bool = False,
        prefill_only: bool = False,
    ) -> str:
        """Queue a request. prefill_only: stop after the first token and HOLD its pages and
        slot for a transfer (release them with `release`)."""
        req = self._new(prompt_token_ids, params, request_id, want_logits=want_logits, prefill_only=prefill_only)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    # ---- disaggregation hooks ----------------------------------------------------------
    def reserve(self, prompt_token_ids, params: SamplingParams, request_id: str) -> tuple[list[int], int, int] | None:
        """Decode side: set aside pages for prompt + 1 tokens and a GDN slot for a state another
        node will write. Returns (block_ids, slot, cached): the first `cached` pages already hold
        the prompt's leading full pages (prefix cache) and are not to be written. None when there
        is no room now."""
        req = self._new(prompt_token_ids, params, request_id)
        if not self.scheduler.reserve(req):
            return None
        self.requests[req.request_id] = req
        return list(req.block_ids), req.slot, req.num_cached_blocks

    def activate(self, request_id: str, first_token: int, drafts: list[int] = ()) -> RequestOutput:
        """Decode side: the reserved state has landed; the request joins the batch (with the
        prefill side's MTP drafts for its first step, when it sent them)."""
        req = self.requests[request_id]
        if req.status is not Status.RESERVED:
            raise ValueError(f"request {request_id!r} is {req.status.value}, not reserved")
        self.scheduler.activate(req, first_token, self.cfg.model.eos_token_ids, drafts)
        out = self._output(req)
        if req.status.is_final:
            del self.requests[request_id]
        return out

    def held(self, request_id: str) -> tuple[list[int], int]:
        """Prefill side: (block_ids, slot) a HELD request's state occupies."""
        req = self.requests[request_id]
        if req.status is not Status.HELD:
            raise ValueError(f"request {request_id!r} is {req.status.value}, not held")
        return list(req.block_ids), req.slot

    def release(self, request_id: str) -> None:
        """Free a HELD (transfer read it) or RESERVED (transfer abandoned) request's memory."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            reason = req.finish_reason if req.status is Status.HELD else "abort"
            self.scheduler.finish(req, reason)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        return self._output(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- steps ----------------------------------------------------------------------
    def _step_input(self, so: SchedulerOutput) -> StepInput:
        rows = []
        mtp = self.cfg.speculative.mtp
        for r in so.rows:
            req = r.request
            start = req.num_computed_tokens
            n_known = r.num_new_tokens - len(r.draft_token_ids)
            p = req.params
            # prompt logprobs: every position of a chunk that still predicts prompt tokens
            plp = p.prompt_logprobs if p.prompt_logprobs is not None and start < len(req.prompt_token_ids) - 1 else None
            nxt = (
                req.token_ids(start + n_known, start + n_known + 1)
                if (mtp or plp is not None) and not r.samples
                else []
            )
            rows.append(
                RowInput(
                    request_id=req.request_id,
                    token_ids=req.token_ids(start, start + n_known) + r.draft_token_ids,
                    start_pos=start,
                    slot=req.slot,
                    block_ids=list(req.block_ids),
                    is_decode=r.is_decode,
                    sample=r.samples,
                    want_logits=req.want_logits and r.samples,
                    params=req.params if r.samples else None,
                    num_draft=len(r.draft_token_ids),
                    next_token=nxt[0] if nxt else None,
                    draft_depths=r.draft_depths if mtp and r.samples else (),
                    prompt_logprobs=plp,
                    num_output=len(req.output_token_ids),
                    history=(req.prompt_token_ids, req.output_token_ids)
                    if r.samples and (p.penalized or p.biased or len(req.output_token_ids) < p.min_tokens)
                    else None,
                )
            )
        return StepInput(rows, so.finished_ids, [c for _, c in so.restores], [c for _, c in so.saves])

    def step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        if so.rows and self.on_schedule is not None:
            self.on_schedule(so)  # e.g. a prefill node opening transfers that this step's rows will finish
        if so.rows:
            try:
                res = self.executor.execute(self._step_input(so))
            except BaseException:
                self.scheduler.abandon(so)  # the step's snapshot pins must not outlive it
                raise
            for rid, lg in res.logits.items():
                self.requests[rid].logits = lg
            self._keep_prompt_logprobs(res.prompt_logprobs)
            touched = self.scheduler.update(so, res.sampled, self.cfg.model.eos_token_ids, res.drafts)
            for rid, lps in res.logprobs.items():  # aligned with the tokens the scheduler kept
                req = self.requests[rid]
                req.output_logprobs += lps[: len(req.output_token_ids) - len(req.output_logprobs)]
            outputs = [self._output(r) for r in touched]
            self._save_final()
        # requests finished without a new token this step (stopped for lack of pages)
        for req in list(self.requests.values()):
            if req.status.is_final:
                if not any(o.request_id == req.request_id for o in outputs):
                    outputs.append(self._output(req))
                del self.requests[req.request_id]
        return outputs

    def _save_final(self) -> None:
        """Snapshots of the final GDN state of the requests this step finished (a conversation's
        next turn resumes there; PrefixPlanner.keep_final): one copy on the executor, no forward."""
        saves = self.scheduler.take_final()
        if not saves:
            return
        try:
            self.executor.execute(StepInput([], [], [], [f.copy for f in saves]))
        except BaseException:
            self.scheduler.end_final(saves, ran=False)
            raise
        self.scheduler.end_final(saves, ran=True)

    def _keep_prompt_logprobs(self, got: dict) -> None:
        """Entry i of req.prompt_logprobs is prompt token i+1's; a chunk computed again (after a
        preemption) adds nothing."""
        for rid, (start, lps) in got.items():
            req = self.requests[rid]
            have = len(req.prompt_logprobs)
            end = len(req.prompt_token_ids) - 1
            if start <= have < start + len(lps):
                req.prompt_logprobs += lps[have - start : end - start]

    def _output(self, req: Request) -> RequestOutput:
        new = req.output_token_ids[req._sent :]
        req._sent = len(req.output_token_ids)
        done = req.status.is_final or req.status is Status.HELD
        metrics = {"num_preemptions": req.num_preemptions, "cached_tokens": req.num_cached_tokens}
        if req.first_token_time is not None:
            metrics["ttft_s"] = req.first_token_time - req.arrival_time
        if done and req.finish_time is not None:
            metrics["e2e_s"] = req.finish_time - req.arrival_time
        drafts = list(req.draft_token_ids) if req.status is Status.HELD else []
        out = RequestOutput(
            req.request_id,
            req.prompt_token_ids,
            list(req.output_token_ids),
            new,
            done,
            req.finish_reason,
            metrics=metrics,
            draft_token_ids=drafts,
            num_cached_tokens=req.num_cached_tokens,
        )
        if req.params.logprobs is not None:
            out.logprobs = req.output_logprobs[req._sent_logprobs :]
            req._sent_logprobs = len(req.output_logprobs)
        if req.params.prompt_logprobs is not None and not req._sent_prompt_logprobs and (new or done):
            out.prompt_logprobs = list(req.prompt_logprobs)
            req._sent_prompt_logprobs = True
        return out

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
            self.executor = None
