"""Speculative decoding's draft proposals (n-gram) and the rollback rule: a row scores its k drafts
in one step, the sampler (engine/sampling/sampler.py) accepts them while they equal its draws,
and the GDN state rolls back to the last accepted token."""

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
