"""What the engine hands back per request: `RequestOutput` (every step), and the vLLM-shaped
parts the offline `LLM.generate` adds to a finished one (`CompletionOutput`, `Logprob`;
engine/llm_results.py fills them)."""

from __future__ import annotations

import msgspec


class Logprob(msgspec.Struct):
    """vLLM's Logprob: one candidate token's log-probability at a position, its rank there (1:
    the most likely; None where unknown) and its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionOutput(msgspec.Struct):
    """vLLM's CompletionOutput: the one completion of a request (index 0)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the chosen tokens' logprobs when logprobs were asked
    logprobs: list[dict[int, Logprob]] | None  # per position: the chosen token and the top ones
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop_token_ids entry that ended it, else None


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
    # params.prompt_logprobs: (token, logprob, top, rank) for prompt tokens 1..n-1, on the request's
    # first output; LLM.generate's finished outputs hold vLLM's [None, {token_id: Logprob}, ...] here
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    # vLLM's shape, filled by LLM.generate: the prompt's text when it was given as text, and the
    # completion (one CompletionOutput); empty on the engine's own outputs
    prompt: str | None = None
    outputs: list[CompletionOutput] = msgspec.field(default_factory=list)
