"""Temperature, top-k, top-p and min-p over a batch of sorted candidate lists, and inverse-CDF
draws: one searchsorted into a row's cumulative kept probability."""

from __future__ import annotations

import torch


def candidate_probs(
    vals: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """vals [N, C] float32 logits sorted descending; temperature (> 0), top_p, min_p float32 [N];
    top_k int64 [N] (0: all C; None: no row has one) -> probabilities [N, C] of the kept
    candidates (0 elsewhere), each row summing to 1."""
    if top_k is not None:
        ranks = torch.arange(vals.shape[-1], device=vals.device)
        cut = torch.where(top_k > 0, top_k, vals.shape[-1])
        vals = vals.masked_fill(ranks >= cut[:, None], float("-inf"))
    probs = torch.softmax(vals / temperature[:, None], dim=-1)
    before = probs.cumsum(-1) - probs  # probability of the candidates ranked above
    keep = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [N, C] (non-negative, any order), u float32 [N] in [0, 1) -> int64 [N]: the first
    column whose cumulative probability exceeds u times the row's total (never a column of
    probability 0: the target is kept strictly below the total)."""
    cum = probs.cumsum(-1)
    total = cum[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target[:, None], right=True)[:, 0]
