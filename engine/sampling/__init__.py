"""Sampling on rank 0 as whole-batch tensor ops: the sampler (sampler.py), the candidate filters
and the draws: an exponential race, an inverse CDF (filters.py), per-request token counts for penalties (penalties.py) and
the counter-based randomness of seeded requests (rng.py)."""

from engine.sampling.sampler import Sampler, TokenLogprob, token_logprobs

__all__ = ["Sampler", "TokenLogprob", "token_logprobs"]
