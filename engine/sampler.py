"""Token sampling on rank 0: greedy, temperature, top-k, top-p, per-request seeded generators
(the same seed gives the same tokens whatever else shares the batch)."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


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
            if p.greedy:
                continue
            row = logits[i].cpu() / p.temperature
            if p.top_k > 0 and p.top_k < row.numel():
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, -1)
            if p.top_p < 1.0:
                sp, idx = probs.sort(descending=True)
                keep = sp.cumsum(-1) - sp < p.top_p  # always keeps the most likely token
                probs = torch.zeros_like(probs).scatter_(0, idx[keep], sp[keep])
            out[i] = int(torch.multinomial(probs, 1, generator=self.generator(request_ids[i], p)))
        return out
