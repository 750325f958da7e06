"""The batch's token bitmask for one sampling step, and its application to the logits in one
tensor op (rows without a constraint untouched; greedy and sampled rows alike).

Per step: each constrained row's matcher is synced to the row's output (matcher.py); llguidance
fills one 32-bit-word bitmask per scored position straight into a CPU tensor, in parallel across
the rows and, when the worker prepared the step, on a thread of its own while the forward runs: for a row with drafts, the mask of the pending position, then the mask after each
draft the grammar allows (stopping at the first it forbids, which the masked draw then cannot
equal, so verification rejects it), rolled back after. The mask goes to the logits' device and
forbidden tokens become -inf. The model's EOS ids are allowed only where the grammar accepts,
and not before a constraint's start token (`start_after_token`: the output may not end before the
part that must follow the constraint, e.g. a required tool call after the thinking)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import llguidance
import numpy as np
import torch

from engine.sampling_params import SamplingParams
from engine.structured.matcher import Matchers, load_tokenizer
from kernels import cpu_ops

log = logging.getLogger(__name__)


class Row(Protocol):
    """What the mask reads of a sampling row (engine/step.py RowInput)."""

    request_id: str
    token_ids: list[int]
    num_draft: int
    params: SamplingParams | None
    history: tuple[list[int], list[int]] | None


_Job = tuple[llguidance.LLMatcher, int, list[int]]  # (matcher, its first position, drafts after it)


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 bitmask (bit b of word w: token 32 w + b allowed) -> [N, vocab_size] bool,
    on the bitmask's device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def forbidden(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, W] int32 bitmask on the CPU -> [N, vocab_size] bool on `device`, True where forbidden.
    On the CPU numpy's unpackbits (one pass, a tenth of the shifts' time at 151,936 ids); on an
    accelerator the words go over (32 times smaller than the unpacked mask) and unpack there."""
    if device.type == "cpu":
        bits = np.unpackbits(np.invert(bitmask.numpy().view(np.uint8)), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab_size].view(np.bool_))
    return ~unpack(bitmask.to(device, non_blocking=True), vocab_size)


@dataclass
class _Plan:
    """One step's masks: the rows they are for, the bitmask, the positions it constrains, and the
    fill running on the mask thread."""

    key: tuple[tuple[str, int], ...]
    bitmask: torch.Tensor
    at: list[int]
    done: Future[None] | None = None


class GrammarMask:
    """The sampler's structured-output step: owns the request matchers (made at the first
    constrained row, from the checkpoint's tokenizer) and writes the batch's masks. `prepare`,
    called before the forward with the step's sampling rows, starts llguidance filling the masks
    on a thread of its own (llguidance releases the GIL), so the fill overlaps the forward;
    `apply` waits for it (or fills at once when nothing was prepared for these rows)."""

    def __init__(self, model_path: str | Path, eos_token_ids: tuple[int, ...] = (), vocab_size: int = 0):
        self.model_path = model_path
        self.eos = eos_token_ids
        self.vocab_size = vocab_size  # the logits' width (0: taken from the first logits)
        self._matchers: Matchers | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._plan: _Plan | None = None
        self._failed: str | None = None  # why the tokenizer did not load
        self._warned: OrderedDict[str, None] = (
            OrderedDict()
        )  # requests whose failed matcher was logged (the last 1,024)
        # llguidance reads the tokenizer (a second or so at 151,936 ids) on the mask thread from
        # the start, beside the weights' loading, rather than before the first constrained token
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        if vocab_size and (Path(model_path) / "tokenizer.json").is_file():
            self._tokenizer = self._mask_thread().submit(load_tokenizer, model_path, vocab_size, eos_token_ids)

    def _mask_thread(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._thread

    def drop(self, request_ids: list[str]) -> None:
        if self._matchers is not None:
            self._matchers.drop(request_ids)

    def matchers(self, vocab_size: int) -> Matchers | None:
        """The request matchers over vocab_size ids; None when llguidance cannot read the
        checkpoint's tokenizer (logged once; constrained rows then may only end)."""
        if self._failed is None and (self._matchers is None or self.vocab_size != vocab_size):
            early, self._tokenizer = self._tokenizer, None
            try:
                if early is not None and vocab_size == self.vocab_size:
                    tok = early.result()
                else:
                    tok = load_tokenizer(self.model_path, vocab_size, self.eos)
                self._matchers = Matchers(tok)
            except (ValueError, RuntimeError, OSError) as e:
                self._failed = str(e)
                log.error("structured outputs are off: the tokenizer does not load into llguidance: %s", e)
                return None
            finally:
                self.vocab_size = vocab_size
            self._executor = llguidance.LLExecutor()
        return self._matchers

    @staticmethod
    def _key(rows: list[Row]) -> tuple[tuple[str, int], ...]:
        return tuple((r.request_id, r.num_draft) for r in rows)

    def prepare(self, rows: list[Row]) -> None:
        """Before the forward: start the masks of these sampling rows (in the sampler's order)."""
        self._settle()
        if not self.vocab_size or not any(r.params is not None and r.params.constraint is not None for r in rows):
            return
        pos, n = [], 0
        for r in rows:
            pos.append(n)
            n += r.num_draft + 1
        plan, jobs = self._make(rows, pos, n, self.vocab_size)
        if jobs:
            plan.done = self._mask_thread().submit(self._run, jobs, plan.bitmask)
        self._plan = plan

    def fill(self, rows: list[Row], pos: list[int], n: int, vocab_size: int) -> tuple[torch.Tensor, list[int]]:
        """The [n, W] bitmask of the n scored positions (all ones where unconstrained) and the
        positions it constrains, computed now."""
        plan, jobs = self._make(rows, pos, n, vocab_size)
        self._run(jobs, plan.bitmask)
        return plan.bitmask, plan.at

    def _make(self, rows: list[Row], pos: list[int], n: int, vocab_size: int) -> tuple[_Plan, list[_Job]]:
        """Sync each constrained row's matcher to its output; the bitmask (EOS alone where a
        matcher failed) and the fill jobs: (matcher, first position, drafts)."""
        ms = self.matchers(vocab_size)
        bm = torch.from_numpy(np.full((n, words(vocab_size)), -1, dtype=np.int32))
        jobs: list[_Job] = []
        at: list[int] = []
        for r, p in zip(rows, pos):
            c = r.params.constraint if r.params is not None else None
            if c is None:
                continue
            output = r.history[1] if r.history is not None else []
            k = r.num_draft
            drafts = list(r.token_ids[len(r.token_ids) - k :]) if k else []
            if ms is None:
                m, first, drafts = None, p, []
            else:
                m, first = ms.sync(r.request_id, c, output), p
                if m is None:  # the start token is not in the output: maybe among the drafts
                    if c.start_after_token not in drafts:
                        at += self._no_end(bm, p, k + 1, vocab_size)
                        continue
                    j = drafts.index(c.start_after_token) + 1
                    at += self._no_end(bm, p, j, vocab_size)
                    m, first, drafts = ms.fresh(c), p + j, drafts[j:]
            at += range(first, first + len(drafts) + 1)
            if m is None or m.is_error():
                why = self._failed if m is None else m.get_error()
                if r.request_id not in self._warned:  # once a request: it stays failed for every step after
                    self._warned[r.request_id] = None
                    if len(self._warned) > 1024:
                        self._warned.popitem(last=False)
                    log.warning("request %s: no grammar matcher (%s); only EOS is allowed", r.request_id, why)
                bm[first] = 0
                for t in self.eos:
                    if t < vocab_size:
                        bm[first, t // 32] |= _bit(t % 32)
                continue
            jobs.append((m, first, drafts))
        return _Plan(self._key(rows), bm, at), jobs

    def _no_end(self, bm: torch.Tensor, first: int, count: int, vocab_size: int) -> range:
        """Positions [first, first + count) come before the constraint's start token: anything
        but the model's EOS (the output may not end before its constrained part)."""
        for t in self.eos:
            if t < vocab_size:
                bm[first : first + count, t // 32] &= ~_bit(t % 32)
        return range(first, first + count)

    def _run(self, jobs: list[_Job], bm: torch.Tensor) -> None:
        """llguidance fills the masks, in parallel over the rows: for a row with drafts, one after
        each draft the grammar allows, rolled back after."""
        if not jobs:
            return
        assert self._executor is not None
        n, one = bm.shape[0], bm.shape[1] * 4  # bytes per mask
        plain = [(m, q) for m, q, d in jobs if not d]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bm.data_ptr(), one, n)
        drafted = [j for j in jobs if j[2]]
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bm.data_ptr(), one, n)

    def _settle(self) -> _Plan | None:
        """The prepared plan, its fill finished (the matchers are free again), and forget it."""
        plan, self._plan = self._plan, None
        if plan is not None and plan.done is not None:
            plan.done.result()
        return plan

    def _masks(self, x: torch.Tensor, rows: list[Row], pos: list[int]) -> tuple[torch.Tensor, list[int]]:
        """The step's bitmask for x [N, V] (the prepared one when it is for these rows) and the
        positions it constrains."""
        n, v = x.shape
        plan = self._settle()
        if plan is not None and plan.key == self._key(rows) and plan.bitmask.shape[0] == n and v == self.vocab_size:
            return plan.bitmask, plan.at
        return self.fill(rows, pos, n, v)

    def greedy(self, x: torch.Tensor, rows: list[Row], pos: list[int]) -> torch.Tensor | None:
        """Every position greedy: each one's first largest logit among what the grammar allows,
        [N] int64, in one pass that writes nothing (CPU operators); None where that op does not
        apply (then `apply`, and the max)."""
        if not _cpu_op(x):
            return None
        bm, _ = self._masks(x, rows, pos)
        return cpu_ops.masked_argmax(x, bm)

    def apply(self, x: torch.Tensor, rows: list[Row], pos: list[int]) -> None:
        """In place on x [N, V] (the step's scored positions): -inf where the grammar forbids."""
        n, v = x.shape
        bm, at = self._masks(x, rows, pos)
        if not at:
            return
        if _cpu_op(x):
            # one pass over the words: a row costs what it forbids, nothing is unpacked
            cpu_ops.mask_logits(x, bm if len(at) == bm.shape[0] else bm[at], torch.tensor(at, dtype=torch.long))
            return
        whole = len(at) == n
        idx = None if whole else torch.tensor(at, dtype=torch.long)
        ban = forbidden(bm if idx is None else bm[idx], v, x.device)
        rows_x = x if idx is None else x[idx.to(x.device)]
        if x.device.type == "cpu" and rows_x.is_contiguous() and rows_x.dtype == torch.float32:
            # numpy's masked copy: a quarter of masked_fill_'s time on the CPU at 151,936 ids
            np.copyto(rows_x.numpy(), -np.inf, where=ban.numpy())
        else:
            rows_x.masked_fill_(ban, float("-inf"))
        if idx is not None:
            x[idx.to(x.device)] = rows_x


def _cpu_op(x: torch.Tensor) -> bool:
    """Whether the CPU operators (kernels/csrc/bitmask.cpp) take these logits."""
    return x.device.type == "cpu" and x.stride(-1) == 1 and cpu_ops.available(x.dtype)


def _bit(b: int) -> int:
    """Bit b of an int32 word, as the signed value torch stores."""
    return -(2**31) if b == 31 else 1 << b
