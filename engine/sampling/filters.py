"""Temperature, min-p, top-k and top-p over a batch of sorted candidate lists, and the two draws:
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


def min_p_floor(z: torch.Tensor, top: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """z [N, C] logits / temperature, top [N, 1] each row's largest, min_p [N] -> bool [N, C]: the
    tokens min-p keeps (probability at least min_p times the most likely one's: z >= top + log
    min_p; every token at min_p 0)."""
    return z >= top + torch.log(min_p)[:, None]


def kept_log_total(x: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """x [N, V] a whole row's logits -> [N]: the logsumexp of logits / temperature over the tokens
    min-p keeps (all of them at min_p 0), which top-p then divides by (min-p comes first)."""
    z = x / temperature[:, None]
    return torch.logsumexp(z.masked_fill(~min_p_floor(z, z.amax(-1, keepdim=True), min_p), float("-inf")), dim=-1)


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
    candidates (0 elsewhere), each row summing to 1. As vLLM orders them: temperature, min-p,
    top-k, then top-p over what those two keep, renormalized. log_total [N]: the candidates are
    the head of a longer row, whose `kept_log_total` this is (top-p then counts the whole row's
    probability)."""
    if top_k is not None:
        ranks = torch.arange(vals.shape[-1], device=vals.device)
        cut = torch.where(top_k > 0, top_k, vals.shape[-1])
        vals = vals.masked_fill(ranks >= cut[:, None], float("-inf"))
    z = vals / temperature[:, None]
    keep = min_p_floor(z, z[:, :1], min_p)
    if log_total is None:
        probs = torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    else:
        probs = torch.exp(z - log_total[:, None]) * keep
    before = probs.cumsum(-1) - probs  # probability of the candidates ranked above
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


def head_suffices(
    head: torch.Tensor, log_total: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """head [N, K] the K largest logits of rows with top-p or min-p and no top-k, sorted
    descending; log_total [N] the whole row's `kept_log_total` -> bool [N]: whether every token
    those filters keep is in the head (the head's probability among min-p's tokens reaches top_p,
    or its last token is below the min-p cut)."""
    z = head / temperature[:, None]
    probs = torch.exp(z - log_total[:, None])
    by_p = (top_p < 1.0) & (probs.sum(-1) >= top_p)
    by_min = (min_p > 0) & ~min_p_floor(z[:, -1:], z[:, :1], min_p)[:, 0]
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
