"""Token sampling on rank 0: greedy, temperature, top-k, top-p, seeded generators, penalties,
logit_bias and min_tokens on the logits before any of that, log-probabilities, and verification
of speculative drafts.

A seeded request samples its i-th new token (and verifies drafts from there) with a generator
seeded from (seed, i): the same seed gives the same tokens whatever else shares the batch and
whichever node samples them (the prefill node its first token, the decode node the rest, or the
decode node all of them). An unseeded request draws from one generator of its own."""

from __future__ import annotations

from collections import Counter

import torch

from engine.sampling_params import SamplingParams
from engine.spec_decode import verify_row

_SEED_STRIDE = 0x9E3779B97F4A7C15  # seeds of consecutive positions far apart

# (token id, log-probability, [(id, log-probability) of the n most likely, most likely first])
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> probabilities after temperature, top-k and top-p."""
    row = logits.float() / p.temperature
    if 0 < p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k, dim=-1).values[..., -1:]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, -1)
    if p.top_p < 1.0:
        sp, idx = probs.sort(dim=-1, descending=True)
        keep = sp.cumsum(-1) - sp < p.top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter_(-1, idx, sp * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def apply_penalties(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[V] logits -> a penalized copy (docs/api.md, "Sampling"): the repetition penalty on every
    token of prompt or output (positive logits divided by it, negative ones multiplied), then
    minus presence_penalty for each distinct output token and frequency_penalty per occurrence."""
    row = row.float().clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=row.device)
        if len(seen):
            v = row[seen]
            row[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if output and (p.presence_penalty or p.frequency_penalty):
        counts = Counter(output)
        ids = torch.tensor(list(counts), dtype=torch.long, device=row.device)
        n = torch.tensor(list(counts.values()), dtype=row.dtype, device=row.device)
        row[ids] -= p.frequency_penalty * n + p.presence_penalty
    return row


def apply_logit_bias(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] logits -> a copy with p.logit_bias added (float32); ids past the row are left out
    (EngineCore.validate refuses ids outside the vocabulary)."""
    row = row.float().clone()
    pairs = [(t, b) for t, b in p.logit_bias if t < row.shape[-1]]
    if pairs:
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=row.device)
        row[ids] += torch.tensor([b for _, b in pairs], dtype=row.dtype, device=row.device)
    return row


def token_logprobs(logprobs: torch.Tensor, targets: list[int], n: int) -> list[TokenLogprob]:
    """logprobs [R, V] (log-softmax) and one target id per row -> each target's log-probability
    and the n most likely ids of its row (ties: the lower id first, as torch.topk orders them)."""
    picked = logprobs.gather(-1, torch.tensor(targets, device=logprobs.device)[:, None])[:, 0].tolist()
    if n:
        top = torch.topk(logprobs, n, dim=-1)
        ids, vals = top.indices.tolist(), top.values.tolist()
    else:
        ids = vals = [[] for _ in targets]
    return [(t, lp, list(zip(i, v))) for t, lp, i, v in zip(targets, picked, ids, vals)]


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: tuple[int, ...] = ()):
        self._gens: dict[str, torch.Generator] = {}
        self._base = torch.Generator().manual_seed(seed)
        self.eos = tuple(eos_token_ids)

    def generator(self, request_id: str, params: SamplingParams, position: int = 0) -> torch.Generator:
        """position: new tokens the request has before this draw."""
        if params.seed is not None:
            return torch.Generator().manual_seed((params.seed + position * _SEED_STRIDE) % 2**63)
        g = self._gens.get(request_id)
        if g is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._base))
            g = self._gens[request_id] = torch.Generator().manual_seed(seed)
        return g

    def drop(self, request_ids: list[str]) -> None:
        for r in request_ids:
            self._gens.pop(r, None)

    def adjust(self, row: torch.Tensor, p: SamplingParams, history) -> torch.Tensor:
        """The logits a request samples from (docs/api.md, "Sampling applies, in order"):
        penalties, then logit_bias, then EOS / stop ids masked while fewer than min_tokens new
        tokens exist. history: (prompt ids, output ids)."""
        prompt, output = history
        if p.penalized:
            row = apply_penalties(row, p, prompt, output)
        if p.biased:
            row = apply_logit_bias(row, p)
        if len(output) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos))
            banned = [t for t in banned if t < row.shape[-1]]
            if banned:
                row = row.float().clone()
                row[banned] = float("-inf")
        return row

    def __call__(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams], histories=None, positions=None
    ) -> list[int]:
        """logits [R, V] float32 -> one token per row. histories: per row (prompt ids, output
        ids), needed for rows with penalties, logit_bias or min_tokens (None elsewhere);
        positions: per row, the new tokens its request has."""
        out = logits.argmax(-1).tolist()
        for i, p in enumerate(params):
            row = logits[i]
            adjusted = histories is not None and histories[i] is not None
            if adjusted:
                row = self.adjust(row, p, histories[i])
            if not p.greedy:
                probs = filtered_probs(row.cpu(), p)
                g = self.generator(request_ids[i], p, positions[i] if positions is not None else 0)
                out[i] = int(torch.multinomial(probs, 1, generator=g))
            elif adjusted:
                out[i] = int(row.argmax())
        return out

    def verify(
        self, logits: torch.Tensor, drafts: list[int], request_id: str, p: SamplingParams, position: int = 0
    ) -> list[int]:
        """logits [k+1, V] at the row's last token and its k drafts -> emitted tokens (1..k+1)."""
        if p.greedy:
            return verify_row(logits, drafts, True, None)
        return verify_row(filtered_probs(logits.cpu(), p), drafts, False, self.generator(request_id, p, position))
