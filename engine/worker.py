"""One tensor-parallel rank: its shard of the weights, its cache pools, and the step loop.

Every rank runs the same step on the same inputs; row-parallel layers sum partial results
with `all_reduce`. Rank 0 computes the logits it needs and samples.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from engine.block_tables import BlockTables
from engine.cache.allocator import CachePools, Capacity, plan_capacity
from engine.cache.memory_plan import MemoryPlan, own_budget, plan_memory
from engine.cache.spec import build_specs
from engine.config import EngineConfig
from engine.config_fields import keeps_fp8
from engine.connector import LayerConnector
from engine.devices import StepFence, bind, node_devices
from engine.loader import load_mtp_weights, load_weights
from engine.memory_profile import CudaProbe, MemoryProbe, profile_steps
from engine.model.batch import ForwardBatch, IntPack, group_fields, make_group
from engine.model.graphs import DecodeGraphs, decode_buckets, graphs_wanted, logits_bytes, plain_decode
from engine.model.layers import AllReduce
from engine.model.mtp import MTPBlock, MTPDrafter
from engine.model.qwen3_5 import Qwen35Model
from engine.sampling import Sampler
from engine.sampling.prompt_logprobs import prompt_logprobs
from engine.step import StepInput, StepOutput
from engine.structured.bitmask import GrammarMask
from engine.units import parse_bytes
from engine.vision.embedder import ImageEmbedder, image_stats
from kernels import cpu_ops
from kernels.points import StatePoints

log = logging.getLogger("pdserve.worker")


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class Worker:
    def __init__(
        self,
        cfg: EngineConfig,
        rank: int = 0,
        all_reduce: AllReduce = _identity,
        broadcast: AllReduce = _identity,
        device: torch.device | None = None,
        probe: MemoryProbe | None = None,
    ):
        """broadcast(t) must give every rank rank 0's `t` (identity when t = 1); device: this
        rank's (default: engine/devices.py's mapping of cfg.device); probe: what measures the device
        when the cache is planned from it (cfg.cache.gpu_memory_utilization; default `CudaProbe`)."""
        self.cfg, self.rank, self._all_reduce = cfg, rank, all_reduce
        if cfg.model.batch_invariant and cfg.cache.recurrent_dtype != "float32":
            raise ValueError(  # a bfloat16 state rounds where each step stores it: once a chunk, once a token
                "--batch-invariant takes a float32 GDN state (--mamba-ssm-cache-dtype auto) "
                "(docs/engine.md, 'Batch-invariant mode')"
            )
        self.broadcast = broadcast
        t = cfg.parallel.tensor_parallel_size
        self.device = device if device is not None else node_devices(cfg.device, t)[rank]
        bind(self.device)  # before any allocation
        m, cuda = cfg.model, self.device.type == "cuda"
        modes = {"--fp8-experts": m.fp8_experts, "--fp8-dense": m.fp8_dense}
        kept = [f"{flag} {v}" for flag, v in modes.items() if keeps_fp8(v, cuda)]
        if m.batch_invariant and m.fp8_block_size is not None and kept:  # refused at start, not at every step
            raise ValueError(
                f"--batch-invariant runs bfloat16 weights, not FP8 ones ({', '.join(kept)}): give --fp8-experts and "
                "--fp8-dense dequantize, or leave --batch-invariant off (docs/engine.md, 'Batch-invariant mode')"
            )
        fraction = cfg.cache.gpu_memory_utilization
        if fraction is not None:
            probe = probe if probe is not None else CudaProbe(self.device)
            probe.start()
        self.fence = StepFence(self.device)
        self.specs = build_specs(cfg, rank)
        k = cfg.speculative.num_tokens
        hidden = cfg.model.hidden_size if cfg.speculative.mtp else 0
        # CUDA graphs pad a decode step to a bucket's size: its padding rows write a slot and page of their own
        padded = graphs_wanted(self.device, t, cfg.cuda_graphs) and not cfg.speculative.mtp
        self.buckets = decode_buckets(cfg.scheduler.max_num_seqs) if padded else ()
        plan_args = (
            cfg.num_state_slots,
            cfg.cache.block_size,
            k,
            cfg.snapshot_fraction,
            hidden,
            int(padded),
            cfg.cache.staging_slots,
        )
        self.memory_plan: MemoryPlan | None = None  # set when planned from the device
        if fraction is None:  # a fixed budget: planned before the weights load
            self.capacity: Capacity = plan_capacity(self.specs, cfg.cache.memory_bytes, *plan_args)
        weights = load_weights(cfg.model, t, rank, self.device)
        self.model = Qwen35Model(cfg.model, weights, t, all_reduce, cfg.max_model_len + 1, self.device)
        spec_rows = cfg.speculative.num_tokens > 0 and self.device.type == "cpu" and cpu_ops.available()
        if rank == 0 and spec_rows and cfg.cache.recurrent_dtype != "float32":
            log.warning(
                "GDN recurrent state in %s: speculative rows' GDN layers run the PyTorch path, not the fused "
                "CPU operator (float32 rollback states only); those steps are slower (docs/benchmarks.md)",
                cfg.cache.recurrent_dtype,
            )
        self.drafter: MTPDrafter | None = None
        # MTP: the last step's hidden states and, per sampling row's slot, the row of its last
        # position (what a final snapshot keeps; read only when one is saved, `_last_hidden`)
        self._tail_hidden: tuple[torch.Tensor | None, dict[int, tuple[int, int, int]]] = (None, {})
        if cfg.speculative.mtp:
            block = MTPBlock(
                cfg.model,
                load_mtp_weights(cfg.model, t, rank, self.device),
                self.model.embed,
                self.model.lm_head,
                t,
                all_reduce,
            )
            self.drafter = MTPDrafter(
                block,
                self.model.rotary,
                cfg.cache.block_size,
                cfg.max_model_len + 1,
                self.device,
                page_ends=cfg.cache.enable_prefix_caching,
            )
        # structured outputs' masks (rank 0 samples): prepared before each forward, applied in the sampler
        self.grammar = GrammarMask(cfg.model.path, cfg.model.eos_token_ids, cfg.model.vocab_size) if rank == 0 else None
        self.sampler = Sampler(cfg.seed, cfg.model.eos_token_ids, self.device, self.grammar, cfg.cuda_graphs)
        self.block_size = cfg.cache.block_size
        self.block_tables = BlockTables(self.max_pages_per_row())  # decode rows' page tables between steps
        self.graphs: DecodeGraphs | None = None  # plain decode steps through CUDA graphs (engine/model/graphs.py)
        self.images: ImageEmbedder | None = None  # the vision encoder and its cache (vision-language checkpoints)
        if cfg.model.vision is not None:
            self.images = ImageEmbedder(cfg.model, parse_bytes(cfg.cache.encoder_cache_memory), self.device)
        self.ext: dict[str, object] = {}  # per-rank objects owned by node packages (e.g. transfer endpoints)
        # the transfer's worker side: told of each layer of a step with `layer_posts` (use_layer_connector)
        self.layer_connector: LayerConnector | None = None
        if probe is not None and fraction is not None:
            self.memory_plan = self._plan(probe, fraction, plan_args)
            self.capacity = self.memory_plan.capacity
            if rank == 0:
                log.info("%s", self.memory_plan.summary())
        self.pools = CachePools(self.specs, self.capacity, self.device, k)
        # no row holds more pages than the cache has: the staged tables are no wider
        width = min(self.max_pages_per_row(), self.capacity.num_blocks)
        if self.buckets and self.drafter is None:
            self.graphs = DecodeGraphs(self.model, self.pools, width, buckets=self.buckets)
            self.graphs.capture_all(self.block_size)
        elif self.device.type == "cpu" and t == 1 and self.drafter is None:  # the same staged steps, no graph
            self.graphs = DecodeGraphs(self.model, self.pools, width, capture=False, packed=True)

    def _plan(self, probe: MemoryProbe, fraction: float, plan_args: tuple) -> MemoryPlan:
        """Run the profile steps on pools of their own, freed after, and plan from what was measured."""
        probe.loaded()
        cap, steps = profile_steps(self.cfg)
        k = self.cfg.speculative.num_tokens
        self.pools = CachePools(self.specs, cap, self.device, k)
        probe.stepping()
        try:
            for step in steps:
                self._execute(step)
        except torch.OutOfMemoryError:
            s = self.cfg.scheduler
            raise ValueError(
                f"the profile step ({s.max_num_batched_tokens} prompt tokens over up to {s.max_num_seqs} rows) ran "
                "out of device memory after the weights loaded: lower --max-num-batched-tokens or --max-num-seqs, "
                "or raise --tp"
            ) from None
        finally:
            ids = [r.request_id for r in steps[0].rows]
            self.sampler.drop(ids)
            if self.drafter is not None:
                self.drafter.drop(ids)
            del self.pools
            self._tail_hidden = (None, {})
        # the decode graphs, captured after the plan, keep their logits
        facts = dataclasses.replace(probe.facts(), graphs=logits_bytes(self.buckets, self.cfg.model.vocab_size))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        given = self.cfg.cache.memory_bytes or None
        agreed = self._smallest(own_budget(facts, fraction, given))  # before any rank can refuse
        return plan_memory(facts, fraction, self.specs, *plan_args, kv_cache_memory=given, agreed=agreed)

    def _smallest(self, n: int) -> int:
        """The smallest of every rank's n: each rank's pools must hold the same pages and slots."""
        t = self.cfg.parallel.tensor_parallel_size
        if t == 1:
            return n
        v = torch.zeros(t, dtype=torch.int64, device=self.device)
        v[self.rank] = n
        return int(self._all_reduce(v).min())

    def use_layer_connector(self, connector: LayerConnector | None) -> None:
        """Set (or with None, clear) the worker side of the engine's transfer connector."""
        self.layer_connector = connector

    def max_pages_per_row(self) -> int:
        """The widest block table a request can have: its longest context plus drafts."""
        return -(-(self.cfg.max_model_len + self.cfg.speculative.num_tokens + 1) // self.block_size) + 1

    def close(self) -> None:
        """Close what node packages keep on this rank (transfer endpoints drain their writes first)."""
        while self.ext:
            key, obj = self.ext.popitem()
            close = getattr(obj, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001 (a rank on its way out: log and close the rest)
                    log.warning("rank %d: closing %s failed", self.rank, key, exc_info=True)

    def call(self, fn, *args, **kwargs):
        """Run fn(worker, ...) on this rank: how node packages (transfer endpoints, stats) reach
        a rank's pools without the engine importing them."""
        return fn(self, *args, **kwargs)

    def build_batch(self, step: StepInput) -> ForwardBatch:
        if self.graphs is not None and not step.layer_posts and (step.plain or plain_decode(step.rows)):
            staged = self.graphs.stage(step.rows, self.block_tables, self.block_size, step.steady)
            if staged is not None:
                return staged
        if self.graphs is not None:
            self.graphs.last_staged = None  # a batch built here: the next step is staged afresh
        ids, pos, slots, logit_idx = [], [], [], []
        bs = self.block_size
        for r in step.rows:
            n = len(r.token_ids)
            if n == 1 and not r.num_draft and r.prompt_logprobs is None:  # a decode row (most of a step)
                q = r.start_pos
                ids.append(r.token_ids[0])
                pos.append(q)
                slots.append(r.block_ids[q // bs] * bs + q % bs)
                if r.sample or r.want_logits:
                    logit_idx.append(len(ids) - 1)
                continue
            ids += r.token_ids
            p = range(r.start_pos, r.start_pos + n)
            pos += p
            slots += [r.block_ids[q // bs] * bs + q % bs for q in p]
            if r.num_draft:  # score the pending token and every draft
                logit_idx += range(len(ids) - r.num_draft - 1, len(ids))
            elif r.sample or r.want_logits:
                logit_idx.append(len(ids) - 1)
        n_dec = sum(r.is_decode for r in step.rows)
        groups = [(rows, dec) for rows, dec in ((step.rows[:n_dec], True), (step.rows[n_dec:], False)) if rows]
        pack = IntPack()
        fields = [pack.add(x) for x in (ids, pos, slots, logit_idx)]
        gf = [
            group_fields(
                pack,
                [len(r.token_ids) for r in rows],
                [r.slot for r in rows],
                [r.start_pos for r in rows],
                [r.block_ids for r in rows],
                self.block_tables.rows(rows).to(self.device, non_blocking=True) if dec else None,
            )
            for rows, dec in groups
        ]
        pack.build(self.device)
        made, tok = {}, 0
        for (_, dec), f in zip(groups, gf):
            made[dec] = make_group(tok, pack, f, dec)
            tok = made[dec].tok_end
        rope, image_rows = self._image_inputs(step, pos)
        inside = [c for c in step.saves if c.offset is not None]
        if inside:  # prefix snapshots inside prefill rows: the GDN layers write them (kernels/points.py)
            row_of = {r.slot: b for b, r in enumerate(step.rows[n_dec:])}
            pts = [(row_of[c.slot], c.offset, c.index) for c in inside]
            made[False].points = StatePoints.build(len(step.rows) - n_dec, pts, self.device)
        return ForwardBatch(
            input_ids=pack[fields[0]],
            positions=pack[fields[1]],
            slot_mapping=pack[fields[2]],
            decode=made.get(True),
            prefill=made.get(False),
            logits_indices=pack[fields[3]],
            rope_positions=rope,
            image_rows=image_rows,
        )

    def _image_inputs(self, step: StepInput, pos: list[int]):
        """(3-D rotary positions [3, T] or None, image rows or None) of a step (batch.py): None,
        None when no row has images or a position offset (the text path unchanged)."""
        if not any(r.mrope is not None or r.rope_delta for r in step.rows):
            return None, None
        axes: list[list[int]] = [[], [], []]
        spans, first = [], 0
        for r in step.rows:
            n = len(r.token_ids)
            if r.mrope is not None:
                for a in range(3):
                    axes[a] += r.mrope[a]
            else:
                shifted = [p + r.rope_delta for p in pos[first : first + n]]
                for a in range(3):
                    axes[a] += shifted
            spans += [(first, s) for s in r.images]
            first += n
        rope = torch.tensor(axes, dtype=torch.int64, device=self.device)
        if not spans:
            return rope, None
        if self.images is None:
            raise ValueError("a step carries images but this model has no vision tower")
        return rope, self.images.rows(spans)

    def execute(self, step: StepInput) -> StepOutput | None:
        before = image_stats(self)
        out = self._execute(step)
        self.fence.record()  # after every kernel the step queued: a push of its pages waits on it
        if out is not None and self.images is not None:
            now = image_stats(self)
            out.images = (
                int(now["images"] - before["images"]),
                now["encoder_seconds"] - before["encoder_seconds"],
                int(now["encoder_cache_hits"] - before["encoder_cache_hits"]),
            )
        return out

    def _after_layer(self, step: StepInput) -> Callable[[int], None] | None:
        """What the forward calls after each decoder layer when the step hands requests' state
        over layer by layer (StepInput.layer_posts): the layer connector, with an event recorded
        after the layer's kernels (None on the CPU)."""
        conn, rids = self.layer_connector, step.layer_posts
        if conn is None or not rids:
            return None
        return lambda layer: conn.layer_done(rids, layer, self.fence.mark())

    def _execute(self, step: StepInput) -> StepOutput | None:
        t0 = time.perf_counter()
        self.sampler.drop(step.finished_ids)
        if self.drafter is not None:
            self.drafter.drop(step.finished_ids)
        if not step.rows:  # at most snapshots of finished requests' final state to save
            if step.fills and self.drafter is not None:  # the drafter's deferred KV first, into their tail pages
                self.drafter.fill(step.fills, self.pools.kv)
            hidden, row = self._tail_hidden
            # accepted drafts past a stop token: the slot takes the state `back` tokens earlier
            self.pools.rollback([(c.slot, row[c.slot][1], row[c.slot][2] - c.back) for c in step.saves if c.back])
            last = {c.index: hidden[row[c.slot][0] - c.back] for c in step.saves if c.last is not None}
            self.pools.snapshots.save(self.pools, step.saves, last)
            return StepOutput({}) if self.rank == 0 else None
        batch = self.build_batch(step)
        if self.grammar is not None:  # llguidance fills the step's masks while the forward runs
            self.grammar.prepare([r for r in step.rows if r.sample or r.num_draft])
        self.pools.snapshots.save(self.pools, step.landed)  # before the forward changes them
        self.pools.snapshots.restore(self.pools, step.restores)  # prefix hits start from their snapshot
        hidden, static = None, False
        after = self._after_layer(step)
        if self.drafter is not None:
            self._resume_drafts(step)
            logits, hidden = self.model.forward(batch, self.pools, want_hidden=True, after_layer=after)
        elif any(r.prompt_logprobs is not None for r in step.rows):  # their logprobs come from the hidden states
            logits, hidden = self.model.forward(batch, self.pools, want_hidden=True, after_layer=after)
            self.pools.snapshots.save(self.pools, step.saves)
        else:
            logits = self.graphs.run(batch) if self.graphs is not None and after is None else None
            # replayed: the logits are in the graph's memory, where the sampler may replay its own graph
            static = logits is not None and self.graphs is not None and self.graphs.replayed
            if logits is None:
                logits = self.model.forward(batch, self.pools, after_layer=after)
            self.pools.snapshots.save(self.pools, step.saves)
        out = StepOutput({})
        if self.rank == 0:
            self._sample(step, logits, out, static, hidden)
        spec_rows = [(b, r) for b, r in enumerate(step.rows) if r.num_draft]  # decode rows come first
        if not spec_rows and self.drafter is None:
            out.seconds = time.perf_counter() - t0
            return out if self.rank == 0 else None
        # every rank needs the emitted tokens: GDN rollback and the MTP block's inputs
        rows_emitted = [out.sampled.get(r.request_id, []) if r.sample else [] for r in step.rows]
        if self.cfg.parallel.tensor_parallel_size > 1:
            k1 = self.cfg.speculative.num_tokens + 1
            emitted = torch.full((len(step.rows), k1), -1, dtype=torch.int64)
            if self.rank == 0:
                for b, toks in enumerate(rows_emitted):
                    if toks:
                        emitted[b, : len(toks)] = torch.tensor(toks)
            emitted = self.broadcast(emitted.to(self.device)).cpu()
            rows_emitted = [[t for t in row if t >= 0] for row in emitted.tolist()]
        if spec_rows:
            self.pools.rollback(
                [(r.slot, b, len(rows_emitted[b]) - 1) for b, r in spec_rows if len(rows_emitted[b]) - 1 < r.num_draft]
            )
        if self.drafter is not None:
            drafts = self.drafter(step.rows, hidden, rows_emitted, self.pools.kv)
            # after the drafter: a snapshot's partial page holds the MTP layer's KV too
            self.pools.snapshots.save(self.pools, step.saves, self._snapshot_hidden(step, hidden))
            if self.cfg.cache.enable_prefix_caching:
                self._tail_hidden = self._last_hidden(step, hidden, rows_emitted)
            if self.rank == 0:
                out.drafts = {r.request_id: d for r, d in zip(step.rows, drafts) if r.sample}
        out.seconds = time.perf_counter() - t0
        return out if self.rank == 0 else None

    def _resume_drafts(self, step: StepInput) -> None:
        """Prefix hits (MTP): the drafter computes its KV at the prefix's last position p - 1 again,
        from the snapshot's hidden state and this request's token p, folded into the row's chunk."""
        row_of = {r.slot: r for r in step.rows}
        for c in step.restores:
            r = row_of[c.slot]
            self.drafter.resume(r.request_id, c.last, r.token_ids[0], self.pools.snapshots.hidden[c.index])

    @staticmethod
    def _last_hidden(
        step: StepInput, hidden: torch.Tensor, emitted: list[list[int]]
    ) -> tuple[torch.Tensor, dict[int, tuple[int, int, int]]]:
        """(hidden, slot -> (row of hidden at the last position whose next token this step made
        known, num_computed_tokens - 1 after it; the row's index in the step; its accepted
        drafts)) for each row that sampled: what a finished request's final-state snapshot keeps
        (PrefixPlanner.keep_final), saved right after the step (`SnapshotCopy.back` goes back from
        there through the rollback states). Nothing is gathered unless a snapshot is saved."""
        row, off = {}, 0
        for b, (r, toks) in enumerate(zip(step.rows, emitted)):
            n = len(r.token_ids)
            if r.sample and toks:
                row[r.slot] = (off + n - 1 - r.num_draft + len(toks) - 1, b, len(toks) - 1)
            off += n
        return hidden, row

    @staticmethod
    def _snapshot_hidden(step: StepInput, hidden: torch.Tensor) -> dict[int, torch.Tensor]:
        """Snapshot entry -> the hidden state at its prefix's last position (`SnapshotCopy.last`)."""
        start, off = {}, 0
        for r in step.rows:
            start[r.slot] = (off, r.start_pos)
            off += len(r.token_ids)
        out = {}
        for c in step.saves:
            o, p = start[c.slot]
            out[c.index] = hidden[o + c.last - p]
        return out

    def _sample(
        self, step: StepInput, logits: torch.Tensor, out: StepOutput, static: bool = False, hidden=None
    ) -> None:
        """Rank 0: sample every sampling row and verify drafts in one batch (engine/sampling),
        keep wanted logits and logprobs (into `out`)."""
        if step.plain:  # one token a row, each sampled, nothing else asked
            emitted, logprobs = self.sampler(logits, step.rows, list(range(len(step.rows))), static, step.steady)
            out.sampled.update((r.request_id, toks) for r, toks in zip(step.rows, emitted))
            out.logprobs.update(logprobs)
            return
        i = off = 0  # the row's first logit row; its first position in `hidden`
        rows, first, wanted = [], [], []  # sampling rows and their first logit row; want_logits rows
        for r in step.rows:
            off += len(r.token_ids)
            if r.num_draft:  # the pending token and every draft are scored
                rows.append(r)
                first.append(i)
                i += r.num_draft + 1
                continue
            if r.prompt_logprobs is not None:
                self._prompt_logprobs(r, hidden[off - len(r.token_ids) : off], out)
            if r.sample:
                rows.append(r)
                first.append(i)
            if r.want_logits:
                wanted.append((i, r))
            if r.sample or r.want_logits:
                i += 1
        for j, r in wanted:  # before the sampler overwrites the logits
            out.logits[r.request_id] = logits[j].to("cpu", copy=True)  # the buffer is the next step's
        if rows:
            emitted, logprobs = self.sampler(logits, rows, first, static)
            out.sampled.update((r.request_id, toks) for r, toks in zip(rows, emitted))
            out.logprobs.update(logprobs)

    def _prompt_logprobs(self, r, hidden: torch.Tensor, out: StepOutput) -> None:
        """hidden [n, H] at every position of a prompt chunk: the log-probability and rank of the
        token after each position that has a known next token (not the last one of a sampling
        row), computed a few hundred positions at a time (engine/sampling/prompt_logprobs.py)."""
        targets = list(r.token_ids[1:]) + ([] if r.next_token is None else [r.next_token])
        if targets:
            lps = prompt_logprobs(self.model.lm_head, hidden[: len(targets)], targets, r.prompt_logprobs)
            out.prompt_logprobs[r.request_id] = (r.start_pos, lps)
