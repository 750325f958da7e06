"""A request's life inside one engine: WAITING -> RUNNING -> FINISHED (preemption sends a
RUNNING request back to WAITING; it then recomputes prompt + output so far).

Disaggregated serving adds two states that hold memory outside the running batch:
- HELD (prefill side): the prompt is computed and the first token sampled; its KV pages and
  GDN slot stay allocated until the transfer has read them (`release`).
- RESERVED (decode side): pages for prompt + 1 tokens and a slot are set aside for a state
  that another node is writing; `activate` adds the request to the running batch with its
  first token, or `release` gives the memory back.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"
    RESERVED = "reserved"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    want_logits: bool = False
    prefill_only: bool = False  # stop after the first token and hold the memory for a transfer
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    logits: object = None  # last-position logits when want_logits
    draft_token_ids: list[int] = field(default_factory=list)  # MTP drafts proposed for the next step
    spec_depth: int = 0  # drafts per step for this request (lowered when acceptance is low); 0: off
    spec_acceptance: float = 1.0  # exponential average of the accepted fraction of its drafts
    spec_first: float = 1.0  # exponential average of "its first draft was accepted"
    spec_probing: bool = False  # depth 1 after depth 0: the next verification decides alone
    spec_gap: int = 0  # depth 0: steps between probes (doubles after a failed probe, capped)
    spec_wait: int = 0  # depth 0: steps left before the next probe
    output_logprobs: list = field(default_factory=list)  # params.logprobs: one TokenLogprob per output token
    prompt_logprobs: list = field(default_factory=list)  # params.prompt_logprobs: one per prompt token after the first
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache at first admission
    held: bool = False  # admission waited for a running request's snapshot (engine/cache/inflight.py)
    block_hashes: list[int] | None = None  # prefix caching: chained hash of each full prompt page
    num_registered: int = 0  # pages of this request registered in the prefix cache
    num_cached_blocks: int = 0  # decode side: leading prompt pages already here (not transferred)
    received: bool = False  # decode side: the prompt's state came from another node (Scheduler.reserve)
    kv_transfer: object = None  # the caller's transfer parameters, read by the connector only (engine/connector.py)
    _sent: int = 0  # output tokens already reported to the caller
    _sent_logprobs: int = 0
    _sent_prompt_logprobs: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]
