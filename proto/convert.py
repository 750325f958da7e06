"""Protobuf messages to and from the engine's records, as plain values (this package imports
nothing else of the project: the callers build their own records from what it returns)."""

from __future__ import annotations

from collections.abc import Iterable

from proto import pb


def sampling_kwargs(sp: pb.SamplingParams) -> dict:
    """Only the fields the caller set, so engine defaults apply to the rest."""
    kw: dict = {"top_k": sp.top_k, "ignore_eos": sp.ignore_eos, "stop_token_ids": tuple(sp.stop_token_ids),
                "min_tokens": sp.min_tokens, "presence_penalty": sp.presence_penalty,
                "frequency_penalty": sp.frequency_penalty}  # fmt: skip
    for name in ("max_tokens", "temperature", "top_p", "seed", "repetition_penalty", "logprobs", "prompt_logprobs",
                 "num_speculative_tokens"):  # fmt: skip
        if sp.HasField(name):
            kw[name] = getattr(sp, name)
    for name in ("temperature", "repetition_penalty"):
        if name in kw:
            kw[name] = float(kw[name])
    if sp.logit_bias:
        kw["logit_bias"] = dict(sp.logit_bias)
    return kw  # `stop` (text) is the router's: nodes see token ids only


def logprobs_pb(entries: Iterable[tuple[int, float, Iterable[tuple[int, float]]]]) -> list[pb.TokenLogprob]:
    """engine TokenLogprob tuples -> their wire form."""
    return [pb.TokenLogprob(token_id=t, logprob=lp, top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in top])
            for t, lp, top in entries]  # fmt: skip
