"""Token sampling on rank 0: greedy, temperature, top-k, top-p, per-request seeded generators
(the same seed gives the same tokens whatever else shares the batch), and verification of
speculative drafts."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from engine.spec_decode import verify_row


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


class Sampler:
    def __init__(self, seed: int = 0):
        self._gens: dict[str, torch.Generator] = {}
        self._base = torch.Generator().manual_seed(seed)

    def generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        g = self._gens.get(request_id)
        if g is None:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._base))
            g = self._gens[request_id] = torch.Generator().manual_seed(seed)
        return g

    def drop(self, request_ids: list[str]) -> None:
        for r in request_ids:
            self._gens.pop(r, None)

    def __call__(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """logits [R, V] float32 -> one token per row."""
        out = logits.argmax(-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                probs = filtered_probs(logits[i].cpu(), p)
                out[i] = int(torch.multinomial(probs, 1, generator=self.generator(request_ids[i], p)))
        return out

    def verify(self, logits: torch.Tensor, drafts: list[int], request_id: str, p: SamplingParams) -> list[int]:
        """logits [k+1, V] at the row's last token and its k drafts -> emitted tokens (1..k+1)."""
        if p.greedy:
            return verify_row(logits, drafts, True, None)
        return verify_row(filtered_probs(logits.cpu(), p), drafts, False, self.generator(request_id, p))
