"""What the engine hands back per request."""

from __future__ import annotations

import msgspec


class RequestOutput(msgspec.Struct):
    """Made for every request every step: a msgspec Struct is built in about a third of a slotted
    dataclass's time (docs/benchmarks.md, "Steady steps under overload; outputs as msgspec
    Structs")."""

    request_id: str
    prompt_token_ids: list[int]
    # every token so far: the request's own list while it runs (it grows with later steps; copying
    # it each step cost O(output) a row), a copy of its own once finished
    output_token_ids: list[int]
    new_token_ids: list[int]  # tokens produced since the last output for this request
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    text: str | None = None
    metrics: dict = msgspec.field(default_factory=dict)  # ttft_s, e2e_s, num_preemptions, cached_tokens
    # prefill-only with MTP: drafts for the first decode step
    draft_token_ids: list[int] = msgspec.field(default_factory=list)
    # params.logprobs: (token, logprob, [(id, logprob) most likely first]) for each of new_token_ids
    logprobs: list | None = None
    # params.prompt_logprobs: the same for prompt tokens 1..n-1, on the request's first output
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
