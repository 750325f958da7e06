"""Speculative decoding: draft proposals and their verification.

A decode row may carry k draft tokens after its last token; the model scores all k+1 positions
in one step (the GDN recurrence writes the state after every token into a scratch area). The
drafts are accepted left to right while the target agrees; the row's GDN conv and recurrent
state then roll back to the state after the last accepted token.

Verification is the sampler's (engine/sampling/sampler.py): every scored position draws its token
as a plain row would, and the drafts are accepted while they equal those draws; for a
deterministic proposer that is the standard rule (accept d with probability p(d), else a draw
from p without d), so the output has the target distribution.
"""

from __future__ import annotations


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
