"""Speculative decoding: draft proposals and their verification.

A decode row may carry k draft tokens after its last token; the model scores all k+1 positions
in one step (the GDN recurrence writes the state after every token into a scratch area). The
drafts are accepted left to right while the target agrees; the row's GDN conv and recurrent
state then roll back to the state after the last accepted token.

Acceptance follows the standard rule for a deterministic proposer: greedy rows accept a draft
iff it is the argmax; sampled rows accept draft d with probability p(d) and, on rejection,
sample from p with d removed. Either way the output has the target distribution.
"""

from __future__ import annotations

import torch


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from ngram_max
    down to ngram_min) and propose the tokens that followed it."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def __call__(self, tokens: list[int], k: int) -> list[int]:
        n_tok = len(tokens)
        for n in range(min(self.ngram_max, n_tok - 1), self.ngram_min - 1, -1):
            suffix = tokens[n_tok - n :]
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []


def verify_row(
    probs_or_logits: torch.Tensor, drafts: list[int], greedy: bool, gen: torch.Generator | None
) -> list[int]:
    """Rows of [k+1, V]: greedy takes logits, sampling takes filtered probabilities.
    Returns the emitted tokens: accepted drafts plus one corrected or bonus token."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        row = probs_or_logits[i]
        if greedy:
            t = int(row.argmax())
            if t != d:
                return out + [t]
        else:
            u = torch.rand((), generator=gen)
            if u >= row[d]:
                rest = row.clone()
                rest[d] = 0.0
                if float(rest.sum()) <= 0.0:
                    return out + [d]
                return out + [int(torch.multinomial(rest, 1, generator=gen))]
        out.append(d)
    last = probs_or_logits[len(drafts)]
    if greedy:
        return out + [int(last.argmax())]
    return out + [int(torch.multinomial(last, 1, generator=gen))]
