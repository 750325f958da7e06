"""EngineCore: validates requests, runs scheduler steps on the executor, reports outputs.

Used by `LLM` (offline batches) and by the serving nodes (one request at a time, streamed).
A bad request is refused with ValueError before it touches the scheduler, so the requests
already in flight carry on. A serving node gives it a transfer `Connector` once at start-up
(`use_connector`); the engine calls it at each point of a request's life (engine/connector.py)
and frees the memory a transfer held when the connector's poll says no write can touch it.
"""

from __future__ import annotations

import itertools
import logging
import os
import time

from engine.cache.block_manager import BlockManager, SlotPool
from engine.cache.prefix import PrefixCache
from engine.config import EngineConfig, dtype_name
from engine.connector import Connector, ConnectorStats, RecvFreed, SendDone, TransferRecord
from engine.executor import make_executor
from engine.outputs import RequestOutput
from engine.rate_window import attended_pairs
from engine.request import Request, RequestIdInUse, Status
from engine.request_state import FINAL
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput, final_step
from engine.spec_decode import NgramProposer
from engine.step import StepInput
from engine.step_input import advance, step_input
from engine.tokenizer import Tokenizer
from engine.vision.inputs import ImageInput
from engine.vision.processing import load_processor
from engine.vision.requests import image_state, unknown_images_view

log = logging.getLogger("pdserve.engine")

# Tests only: each step sleeps this many seconds per prompt token it computed, a prefill rate the
# admission tests can predict (tests/serve/test_priority.py); unset or 0 in any real deployment.
TEST_PREFILL_DELAY_ENV = "PDSERVE_TEST_PREFILL_DELAY_PER_TOKEN_S"


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
        if cfg.model.vision is not None:
            load_processor(cfg.model.path)  # images are checked here: at start, not on the first one
        self._ids = itertools.count()
        self.image_totals: tuple[int, float, int] = (0, 0.0, 0)  # images encoded, seconds, encoder-cache hits
        self.prompt_tokens_computed = 0  # total since start: prompt tokens its steps computed
        self.prompt_pairs_computed = 0  # ... and their (token, context) pairs: attention's work (PrefillCost)
        self.connector: Connector | None = None  # set once by use_connector
        self._last_plain: StepInput | None = None  # the last step, when plain: the next may advance it
        self._test_delay_s = float(os.environ.get(TEST_PREFILL_DELAY_ENV) or 0.0)
        if self._test_delay_s:
            log.warning("%s=%g: prefill throttled (a test setting)", TEST_PREFILL_DELAY_ENV, self._test_delay_s)
        log.info(
            "engine ready in %.1f s: %s, %s, max_model_len %d, tp=%d, %s",
            time.perf_counter() - t0,
            cfg.model.architecture,
            dtype_name(cfg.model.dtype),
            cfg.max_model_len,
            cfg.parallel.tensor_parallel_size,
            self.capacity.summary(),
        )

    def use_connector(self, connector: Connector) -> None:
        """The transfer this engine's requests use (a serving node sets it once, before its loop
        starts)."""
        if self.connector is not None:
            raise RuntimeError("the engine already has a connector")
        self.connector = connector

    def _prefix_cache(self) -> PrefixCache | None:
        c = self.cfg.cache
        if not c.enable_prefix_caching:
            return None
        if self.capacity.num_snapshots == 0:
            log.warning(
                "prefix caching is off: prefix_snapshot_memory=%.3g of the cache holds no snapshot", c.snapshot_fraction
            )
            return None
        return PrefixCache(
            self.blocks, self.capacity.num_snapshots, c.snapshot_interval, self.cfg.speculative.mtp, c.message_break
        )

    def _propose(self, tokens: list[int], k: int) -> list[int]:
        return self.proposer(tokens, k) if self.proposer is not None else []

    # ---- requests -------------------------------------------------------------------
    def validate(self, prompt_token_ids, params) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams (got {type(params).__name__})")
        if not isinstance(prompt_token_ids, (list, tuple)) or len(prompt_token_ids) == 0:
            raise ValueError("empty prompt: give at least one token")
        vocab = self.cfg.model.vocab_size
        ids = prompt_token_ids  # the common case at C speed (min, max); token by token only to name the bad ones
        ok = all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < vocab
        bad = [] if ok else [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} out of range [0, {vocab}) for this model's vocabulary")
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token id(s) {bad[:5]} out of range [0, {vocab}) for this model's vocabulary")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} out of range [0, {vocab}) for this model's vocabulary")
        if params.constraint is not None and not Tokenizer.exists(self.cfg.model.path):
            raise ValueError(
                "structured outputs (constraint) need the checkpoint's tokenizer: it has no tokenizer.json"
            )
        k, cap = self.cfg.speculative.num_tokens, params.num_speculative_tokens
        if cap is not None and cap > k:
            raise ValueError(
                f"num_speculative_tokens {cap} exceeds this server's {k} (--num-speculative-tokens): "
                f"ask for at most {k}" + (" (speculative decoding is off)" if k == 0 else "")
            )
        n, limit = len(prompt_token_ids), self.cfg.max_model_len
        if n > limit or (n == limit and params.max_tokens != 1):  # one token fits (a prompt scored, as vLLM)
            raise ValueError(f"prompt of {n} tokens leaves no room to generate: max_model_len is {limit}")
        need = self.blocks.blocks_for(n + 1)
        if need > self.capacity.num_blocks:
            raise ValueError(
                f"prompt of {n} tokens needs {need} KV blocks but the cache holds {self.capacity.num_blocks}; "
                "raise kv_cache_memory"
            )

    def _new(self, prompt_token_ids, params, request_id, images=(), pixels=True, **kw) -> Request:
        """A validated request; with images (checked against the prompt, their bytes decoded and
        hashed when `pixels`), its 3-D rotary positions and position offset too."""
        self.validate(prompt_token_ids, params)
        state = image_state(self.cfg.model, list(prompt_token_ids), tuple(images), pixels)
        done = kw.get("output_token_ids", ())
        limit = self.scheduler.context_len  # max_model_len, or the KV cache's tokens where fewer
        if done and len(prompt_token_ids) + len(done) >= limit:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens and {len(done)} output tokens leave no room to generate: "
                f"a context stops at {limit} tokens (max_model_len {self.cfg.max_model_len}, KV cache {self.capacity.max_tokens})"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestIdInUse(f"request id {rid!r} is already in flight")
        req = Request(rid, list(prompt_token_ids), params, **kw)
        req.images, req.mrope, req.rope_delta = state
        return req

    def add_request(
        self,
        prompt_token_ids,
        params: SamplingParams,
        request_id: str | None = None,
        want_logits: bool = False,
        prefill_only: bool = False,
        transfer: object = None,
        images: tuple[ImageInput, ...] = (),
    ) -> str:
        """Queue a request. prefill_only: stop after the first token and HOLD its pages and
        slot for a transfer (released once the connector's push ends, or with `release`).
        transfer: the connector's parameters for it (a prefill node's push target). images: the
        prompt's images on their <|image_pad|> runs (docs/images.md)."""
        req = self._new(
            prompt_token_ids, params, request_id, images, want_logits=want_logits, prefill_only=prefill_only
        )
        req.kv_transfer = transfer
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        if self.connector is not None:
            self.connector.request_added(req)
        return req.request_id

    def resume_request(
        self,
        prompt_token_ids,
        params: SamplingParams,
        output_token_ids,
        request_id: str | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> str:
        """Queue a request that already has output tokens (produced elsewhere, e.g. by a node that
        failed mid-stream): the engine computes prompt + those tokens as one prefill (the path a
        preempted request takes), then decodes on. Outputs report only the tokens after them;
        max_tokens counts them too. The connector hears of it (`request_resumed`)."""
        done = [int(t) for t in output_token_ids]
        vocab = self.cfg.model.vocab_size
        bad = [t for t in done if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"resumed output token id(s) {bad[:5]} out of range [0, {vocab})")
        req = self._new(prompt_token_ids, params, request_id, images, output_token_ids=done)
        req._sent = len(done)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        if self.connector is not None:
            self.connector.request_resumed(req)
        return req.request_id

    # ---- disaggregation hooks ----------------------------------------------------------
    def reserve(self, prompt_token_ids, params: SamplingParams, request_id: str) -> tuple[list[int], int, int] | None:
        """Decode side: set aside pages for prompt + 1 tokens and a GDN slot for a state another
        node will write. Returns (block_ids, slot, cached): the first `cached` pages already hold
        the prompt's leading full pages (prefix cache) and are not to be written. None when there
        is no room now."""
        got = self.reserve_transfer(prompt_token_ids, params, request_id)
        return None if got is None else got[0]

    def reserve_transfer(
        self,
        prompt_token_ids,
        params: SamplingParams,
        request_id: str,
        transfer: object = None,
        images: tuple[ImageInput, ...] = (),
    ) -> tuple[tuple[list[int], int, int], object] | None:
        """`reserve`, then the connector adopts the reservation (`transfer`: its parameters, e.g.
        a lease): ((block_ids, slot, cached), the connector's answer). If the connector raises,
        the memory goes back and the error propagates. images: the prompt's images as their
        hashes and places (no pixels are needed here): the prefix cache's page names; a prompt
        with image placeholders and no images given shares no cached page (its rope_delta comes
        with the transfer, docs/images.md)."""
        req = self._new(prompt_token_ids, params, request_id, images, pixels=False)
        v = self.cfg.model.vision
        req.no_pixels = v is not None and v.image_token_id in req.prompt_token_ids
        if not images:
            req._hash_prompt = unknown_images_view(self.cfg.model, req.prompt_token_ids)
        req.kv_transfer = transfer
        if not self.scheduler.reserve(req):
            return None
        self.requests[req.request_id] = req
        answer = None
        if self.connector is not None:
            try:
                answer = self.connector.request_reserved(req)
            except BaseException:
                self._free(request_id)
                raise
        return (list(req.block_ids), req.slot, req.num_cached_blocks), answer

    def activate(self, request_id: str, first_token: int, drafts: list[int] = ()) -> RequestOutput:
        """Decode side: the reserved state has landed; the request joins the batch (with the
        prefill side's MTP drafts for its first step, when it sent them). The connector first
        takes the transferred state (and may refuse: its error propagates)."""
        req = self.requests[request_id]
        if req.status is not Status.RESERVED:
            raise ValueError(f"request {request_id!r} is {req.status.value}, not reserved")
        if self.connector is not None:
            self.connector.request_activating(req)
        self.scheduler.activate(req, first_token, self.cfg.model.eos_token_ids, drafts)
        out = self._output(req)
        if req.status.is_final:
            self._save_final()  # its final state (finished by its first token): slot and page back now
            self._gone(req)
        return out

    def held(self, request_id: str) -> tuple[list[int], int]:
        """Prefill side: (block_ids, slot) a HELD request's state occupies."""
        req = self.requests[request_id]
        if req.status is not Status.HELD:
            raise ValueError(f"request {request_id!r} is {req.status.value}, not held")
        return list(req.block_ids), req.slot

    def release(self, request_id: str, reason: str = "released") -> bool:
        """Give back a HELD (transfer read it) or RESERVED (transfer abandoned) request's memory.
        True: freed now; False: a transfer still runs on it, which the connector aborts; the memory
        comes back with the poll that ends it (SendDone / RecvFreed)."""
        if self.connector is not None and self.connector.tracks(request_id):
            self.connector.abort(request_id, reason)
            return False
        self._free(request_id)
        return True

    def _free(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            reason = req.finish_reason if req.status is Status.HELD else "abort"
            self.scheduler.finish(req, reason or "abort")

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request; a HELD or RESERVED one with a transfer in flight is released instead
        (its memory back once the transfer is quiet) and gives no output."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status in (Status.HELD, Status.RESERVED):
            self.release(request_id, "aborted")
            return None
        del self.requests[request_id]
        self.scheduler.finish(req, "abort")
        if self.connector is not None:
            self.connector.request_finished(req, "abort")
        return self._output(req)

    # ---- the transfer (through the connector) --------------------------------------------
    def tracks_transfer(self, request_id: str) -> bool:
        return self.connector is not None and self.connector.tracks(request_id)

    def abort_transfer(self, request_id: str, reason: str) -> bool:
        """End a request's transfer (its memory back once quiet). False: none in flight."""
        return self.connector is not None and self.connector.abort(request_id, reason)

    def writes_awaited(self) -> int:
        """Reservations here whose state a prefill node still computes or writes (Connector.writes_awaited)."""
        return 0 if self.connector is None else self.connector.writes_awaited()

    def has_transfers(self) -> bool:
        return self.connector is not None and self.connector.has_work()

    def poll_transfers(self) -> list[TransferRecord]:
        """Drive the transfers once: frees the memory of those that ended, returns their records."""
        if self.connector is None:
            return []
        records = list(self.connector.poll())
        for r in records:
            if isinstance(r, (SendDone, RecvFreed)):
                self._free(r.request_id)  # no write can still touch it
        return records

    def transfer_state(self, request_id: str) -> TransferRecord | None:
        return self.connector.current(request_id) if self.connector is not None else None

    def transfer_stats(self) -> ConnectorStats | None:
        return self.connector.stats() if self.connector is not None else None

    def _gone(self, req: Request) -> None:
        """A FINISHED request leaves the engine."""
        del self.requests[req.request_id]
        if self.connector is not None:
            self.connector.request_finished(req, req.finish_reason or "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- steps ----------------------------------------------------------------------
    def _step_input(self, so: SchedulerOutput, layer_posts: list[str] | None = None) -> StepInput:
        last, self._last_plain = self._last_plain, None  # a step that fails leaves nothing to advance
        step = advance(last, so) if last is not None and not layer_posts else None
        if step is None:
            merge = self.cfg.model.vision.spatial_merge_size if self.cfg.model.vision is not None else 0
            step = step_input(so, self.cfg.speculative.mtp, merge, layer_posts or [])
        return step

    def _ran(self, step: StepInput) -> None:
        """After a step ran: a plain one is kept, the next step may advance it."""
        self._last_plain = step if step.plain else None

    def step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        conn = self.connector
        layer_posts: list[str] = []
        if so.rows and conn is not None:  # e.g. a prefill side opening pushes that this step's rows finish
            layer_posts = list(conn.rows_scheduled(so) or ())
        # where each row starts (for the connector's prompt chunks) and the prompt tokens: none in a steady step
        starts = None if so.steady else [r.request.num_computed_tokens for r in so.rows]
        prompt_tokens = 0 if so.steady else sum(r.num_new_tokens for r in so.rows if not r.is_decode)
        pairs = 0 if so.steady else sum(attended_pairs(r) for r in so.rows if not r.is_decode)
        if so.rows:
            t0 = time.monotonic()
            try:
                step = self._step_input(so, layer_posts)
                res = self.executor.execute(step)
            except BaseException:
                self.scheduler.abandon(so)  # the step's snapshot pins must not outlive it
                raise
            if not so.steady and all(not r.is_decode for r in so.rows):  # a decode row's time is not the prompt's
                self.scheduler.classes.observe(prompt_tokens, time.monotonic() - t0)
            self._ran(step)
            self.prompt_tokens_computed += prompt_tokens
            self.prompt_pairs_computed += pairs
            (n, secs, hits), (dn, dsecs, dhits) = self.image_totals, res.images
            self.image_totals = (n + dn, secs + dsecs, hits + dhits)
            for rid, lg in res.logits.items():
                self.requests[rid].logits = lg
            self._keep_prompt_logprobs(res.prompt_logprobs)
            touched = self.scheduler.update(so, res.sampled, self.cfg.model.eos_token_ids, res.drafts)
            for rid, lps in res.logprobs.items():  # aligned with the tokens the scheduler kept
                req = self.requests[rid]
                req.output_logprobs += lps[: len(req.output_token_ids) - len(req.output_logprobs)]
            outputs = [self._output(r) for r in touched]
            if self._test_delay_s:
                time.sleep(self._test_delay_s * prompt_tokens)
            if conn is not None:
                self._tell_connector(conn, so, starts, touched)
            self._save_final()
        # requests finished without a new token this step (stopped for lack of pages)
        ended, self.scheduler.ended = self.scheduler.ended, []
        # those still here: abort, activate and release let theirs go themselves
        finals = [req for req in ended if self.requests.get(req.request_id) is req]
        if finals:
            sent = {o.request_id for o in outputs}
            for req in finals:
                if req.request_id not in sent:
                    outputs.append(self._output(req))
                self._gone(req)
        return outputs

    @staticmethod
    def _tell_connector(conn: Connector, so: SchedulerOutput, starts: list[int] | None, touched: list[Request]) -> None:
        """After a step: the prompt chunks it computed (none: starts None), then the requests it
        left HELD."""
        for row, start in zip(so.rows, starts or ()):
            req = row.request
            n = len(req.prompt_token_ids)
            if start < n and not req.received:
                conn.prefill_chunk_done(req, start, min(n, max(start, req.num_computed_tokens)))
        for req in touched:
            if req.status is Status.HELD:
                conn.prompt_prefilled(req)

    def _save_final(self) -> None:
        """Snapshots of the final GDN state of the requests this step finished (a conversation's
        next turn resumes there; PrefixPlanner.keep_final): one copy on the executor, no forward."""
        saves = self.scheduler.take_final()
        if not saves:
            return
        try:
            self.executor.execute(final_step(saves))
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
        ids = req.output_token_ids
        sent, req._sent = req._sent, len(ids)
        first = req.first_token_time
        if req.status is Status.RUNNING:  # most outputs: a running request's new tokens
            metrics = {"num_preemptions": req.num_preemptions, "cached_tokens": req.num_cached_tokens}
            if first is not None:
                metrics["ttft_s"] = first - req.arrival_time
            rid, new, why, cached = req.request_id, ids[sent:], req.finish_reason, req.num_cached_tokens
            out = RequestOutput(
                rid, req.prompt_token_ids, ids, new, False, why, None, metrics, num_cached_tokens=cached
            )
        else:
            out = self._other_output(req, ids[sent:])
        if req.params.logprobs is not None:
            out.logprobs = req.output_logprobs[req._sent_logprobs :]
            req._sent_logprobs = len(req.output_logprobs)
        if (
            req.params.prompt_logprobs is not None
            and not req._sent_prompt_logprobs
            and (out.new_token_ids or out.finished)
        ):
            out.prompt_logprobs = list(req.prompt_logprobs)
            req._sent_prompt_logprobs = True
        return out

    @staticmethod
    def _other_output(req: Request, new: list[int]) -> RequestOutput:
        """The output of a request that is not running: finished, held for a transfer, or waiting
        (preempted)."""
        ids, status = req.output_token_ids, req.status
        held = status is Status.HELD
        done = held or status in FINAL
        metrics = {"num_preemptions": req.num_preemptions, "cached_tokens": req.num_cached_tokens}
        if req.first_token_time is not None:
            metrics["ttft_s"] = req.first_token_time - req.arrival_time
        if done and req.finish_time is not None:
            metrics["e2e_s"] = req.finish_time - req.arrival_time
        if req.ended_seq:
            metrics["ended"] = req.ended_seq  # the decode node's last message carries it (node_ended)
        return RequestOutput(
            req.request_id,
            req.prompt_token_ids,
            list(ids) if done else ids,
            new,
            done,
            req.finish_reason,
            None,
            metrics,
            list(req.draft_token_ids) if held else [],
            num_cached_tokens=req.num_cached_tokens,
        )

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
            self.executor = None
