"""The batch's token bitmask for one sampling step, and its application to the logits in one
tensor op (rows without a constraint untouched; greedy and sampled rows alike).

Per step: each constrained row's matcher is synced to the row's output (matcher.py); llguidance
fills one 32-bit-word bitmask per scored position straight into a CPU tensor, in parallel across
the rows: for a row with drafts, the mask of the pending position, then the mask after each
draft the grammar allows (stopping at the first it forbids, which the masked draw then cannot
equal, so verification rejects it), rolled back after. The mask goes to the logits' device and
forbidden tokens become -inf. The model's EOS ids are allowed only where the grammar accepts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import llguidance
import torch

from engine.sampling_params import SamplingParams
from engine.structured.matcher import Matchers, load_tokenizer

log = logging.getLogger(__name__)


class Row(Protocol):
    """What the mask reads of a sampling row (engine/step.py RowInput)."""

    request_id: str
    token_ids: list[int]
    num_draft: int
    params: SamplingParams | None
    history: tuple[list[int], list[int]] | None


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 bitmask (bit b of word w: token 32 w + b allowed) -> [N, vocab_size] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


class GrammarMask:
    """The sampler's structured-output step: owns the request matchers (made at the first
    constrained row, from the checkpoint's tokenizer) and writes the batch's masks."""

    def __init__(self, model_path: str | Path, eos_token_ids: tuple[int, ...] = ()):
        self.model_path = model_path
        self.eos = eos_token_ids
        self._matchers: Matchers | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.vocab_size = 0

    def drop(self, request_ids: list[str]) -> None:
        if self._matchers is not None:
            self._matchers.drop(request_ids)

    def matchers(self, vocab_size: int) -> Matchers:
        if self._matchers is None or self.vocab_size != vocab_size:
            self._matchers = Matchers(load_tokenizer(self.model_path, vocab_size, self.eos))
            self._executor = llguidance.LLExecutor()
            self.vocab_size = vocab_size
        return self._matchers

    def fill(self, rows: list[Row], pos: list[int], n: int, vocab_size: int) -> tuple[torch.Tensor, list[int]]:
        """The [n, W] bitmask of the n scored positions (all ones where unconstrained) and the
        positions it constrains."""
        ms = self.matchers(vocab_size)
        assert self._executor is not None
        bm = torch.full((n, words(vocab_size)), -1, dtype=torch.int32)
        jobs: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        broken: list[int] = []
        at: list[int] = []
        for r, p in zip(rows, pos):
            c = r.params.constraint if r.params is not None else None
            if c is None:
                continue
            output = r.history[1] if r.history is not None else []
            k = r.num_draft
            drafts = list(r.token_ids[len(r.token_ids) - k :]) if k else []
            m = ms.sync(r.request_id, c, output)
            first = p
            if m is None:  # the start token is not in the output: maybe among the drafts
                if c.start_after_token not in drafts:
                    continue
                j = drafts.index(c.start_after_token) + 1
                m, first, drafts = ms.fresh(c), p + j, drafts[j:]
            at += range(first, first + len(drafts) + 1)
            if m.is_error():
                log.warning(
                    "request %s: its grammar matcher failed (%s); only EOS is allowed", r.request_id, m.get_error()
                )
                broken.append(first)
                continue
            jobs.append((m, first, drafts))
        one = bm.shape[1] * 4  # bytes per mask
        plain = [(m, q) for m, q, d in jobs if not d]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bm.data_ptr(), one, n)
        drafted = [j for j in jobs if j[2]]
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bm.data_ptr(), one, n)
        for q in broken:
            bm[q] = 0
            for t in self.eos:
                if t < vocab_size:
                    bm[q, t // 32] |= _bit(t % 32)
        return bm, at

    def apply(self, x: torch.Tensor, rows: list[Row], pos: list[int]) -> None:
        """In place on x [N, V] (the step's scored positions): -inf where the grammar forbids."""
        n, v = x.shape
        bm, at = self.fill(rows, pos, n, v)
        if not at:
            return
        if len(at) == n:  # every position: in place
            x.masked_fill_(~unpack(bm.to(x.device, non_blocking=True), v), float("-inf"))
            return
        idx = torch.tensor(at, dtype=torch.long)
        allowed = unpack(bm[idx].to(x.device, non_blocking=True), v)
        idx = idx.to(x.device)
        x[idx] = x[idx].masked_fill(~allowed, float("-inf"))


def _bit(b: int) -> int:
    """Bit b of an int32 word, as the signed value torch stores."""
    return -(2**31) if b == 31 else 1 << b
