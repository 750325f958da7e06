"""Protobuf messages to and from the engine's records, as plain values (this package imports
nothing else of the project: the callers build their own records from what it returns)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict

from proto import pb


class SamplingKwargs(TypedDict, total=False):
    """Keyword arguments of the engine's SamplingParams (named here, not imported)."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: dict[int, float]
    logprobs: int
    prompt_logprobs: int
    num_speculative_tokens: int


def sampling_kwargs(sp: pb.SamplingParams) -> SamplingKwargs:
    """Only the fields the caller set, so engine defaults apply to the rest."""
    kw = SamplingKwargs(
        top_k=sp.top_k,
        ignore_eos=sp.ignore_eos,
        stop_token_ids=tuple(sp.stop_token_ids),
        min_tokens=sp.min_tokens,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
    )
    # `optional` fields: set only when present on the wire
    if sp.HasField("max_tokens"):
        kw["max_tokens"] = sp.max_tokens
    if sp.HasField("temperature"):
        kw["temperature"] = float(sp.temperature)
    if sp.HasField("top_p"):
        kw["top_p"] = sp.top_p
    if sp.HasField("min_p"):
        kw["min_p"] = float(sp.min_p)
    if sp.HasField("seed"):
        kw["seed"] = sp.seed
    if sp.HasField("repetition_penalty"):
        kw["repetition_penalty"] = float(sp.repetition_penalty)
    if sp.HasField("logprobs"):
        kw["logprobs"] = sp.logprobs
    if sp.HasField("prompt_logprobs"):
        kw["prompt_logprobs"] = sp.prompt_logprobs
    if sp.HasField("num_speculative_tokens"):
        kw["num_speculative_tokens"] = sp.num_speculative_tokens
    if sp.logit_bias:
        kw["logit_bias"] = dict(sp.logit_bias)
    return kw  # `stop` (text) is the router's: nodes see token ids only


def logprobs_pb(entries: Iterable[tuple[int, float, Iterable[tuple[int, float]]]]) -> list[pb.TokenLogprob]:
    """engine TokenLogprob tuples -> their wire form."""
    return [
        pb.TokenLogprob(token_id=t, logprob=lp, top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in top])
        for t, lp, top in entries
    ]
