"""Temperature, top-k, top-p and min-p over a batch of sorted candidate lists, and inverse-CDF
draws: what stays is always a prefix of a row's candidates, so a draw is one searchsorted."""

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
    """probs [N, C] (rows sum to 1, non-zero on a prefix), u float32 [N] in [0, 1) -> int64 [N]:
    the first candidate whose cumulative probability exceeds u (never one of probability 0)."""
    cum = probs.cumsum(-1)
    j = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True)[:, 0]
    last = (probs > 0).sum(-1) - 1
    return torch.minimum(j, last)
