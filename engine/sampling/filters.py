"""Temperature, top-k, top-p and min-p over a batch of sorted candidate lists, and the two draws:
the exponential race of the filtered rows (each kept token's probability over its own Exp(1)
variate, the largest wins: the token with probability p wins with probability p, and which one
wins depends on each token's own variate, not on the candidates' order) and the inverse-CDF
draw of rows with temperature alone (one searchsorted into the cumulative probability, in id
order). `topk_reference` is the candidates' order that kernels/triton/topk.py keeps."""

from __future__ import annotations

import torch


def topk_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of x [N, V] as float32, descending, ties to the lower id, NaN as
    -inf (a stable sort): (values [N, k], ids int64 [N, k])."""
    x = torch.nan_to_num(x.float(), nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[:, :k].contiguous(), ids[:, :k].contiguous()


def candidate_probs(
    vals: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    log_total: torch.Tensor | None = None,
) -> torch.Tensor:
    """vals [N, C] float32 logits sorted descending; temperature (> 0), top_p, min_p float32 [N];
    top_k int64 [N] (0: all C; None: no row has one) -> probabilities [N, C] of the kept
    candidates (0 elsewhere), each row summing to 1. log_total [N]: the candidates are the head
    of a longer row, whose logsumexp of logits / temperature this is (top-p then counts the
    whole row's probability)."""
    if top_k is not None:
        ranks = torch.arange(vals.shape[-1], device=vals.device)
        cut = torch.where(top_k > 0, top_k, vals.shape[-1])
        vals = vals.masked_fill(ranks >= cut[:, None], float("-inf"))
    if log_total is None:
        probs = torch.softmax(vals / temperature[:, None], dim=-1)
    else:
        probs = torch.exp(vals / temperature[:, None] - log_total[:, None])
    before = probs.cumsum(-1) - probs  # probability of the candidates ranked above
    keep = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


def head_suffices(
    head: torch.Tensor, log_total: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """head [N, K] the K largest logits of rows with top-p or min-p and no top-k, sorted
    descending; log_total [N] the whole row's logsumexp of logits / temperature -> bool [N]:
    whether every token those filters keep is in the head (its probability reaches top_p, or its
    last token is below the min-p cut)."""
    probs = torch.exp(head / temperature[:, None] - log_total[:, None])
    by_p = (top_p < 1.0) & (probs.sum(-1) >= top_p)
    by_min = (min_p > 0) & (probs[:, -1] < min_p * probs[:, 0])
    return by_p | by_min


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [N, C] (non-negative, any order), u float32 [N] in [0, 1) -> int64 [N]: the first
    column whose cumulative probability exceeds u times the row's total (never a column of
    probability 0: the target is kept strictly below the total)."""
    cum = probs.cumsum(-1)
    total = cum[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target[:, None], right=True)[:, 0]


def race(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """probs [N, C] (non-negative, 0: not kept), exponentials float32 [N, C] > 0, each column's
    own -> int64 [N]: the column whose probs / exponentials is largest (never a column of
    probability 0 while the row keeps any)."""
    return (probs / exponentials).argmax(-1)
