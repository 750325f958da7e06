"""A request inside one engine: its tokens, its memory (KV pages, GDN slot), its state and its
speculative draft depth. Its states and the allowed moves are in engine/request_state.py; the
scheduler moves it only through `Request.move`, which checks them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.prefix_hash import salted
from engine.request_state import Status, TransitionError, check_transition
from engine.sampling_params import SamplingParams
from engine.vision.inputs import ImageInput, hash_view

if TYPE_CHECKING:
    from engine.sampling import TokenLogprob
    from engine.sampling.prompt_logprobs import PromptLogprob

__all__ = ["Request", "RequestIdInUse", "SpecDepth", "Status", "TransitionError"]


class RequestIdInUse(ValueError):
    """A new request under an id the engine (or the node's loop) still holds: a request in flight,
    or one ending (a reservation whose transfer is not quiet yet). Nodes answer ALREADY_EXISTS."""


@dataclass(frozen=True)
class SpecDepth:
    """A request's speculative draft depth and what decides it (engine/scheduler/spec_depth.py:
    the pure policy that returns the next value after each sampling step)."""

    depth: int = 0  # drafts per step for this request (lowered when acceptance is low); 0: off
    acceptance: float = 1.0  # exponential average of the accepted fraction of its drafts
    first: float = 1.0  # exponential average of "its first draft was accepted"
    probing: bool = False  # depth 1 after depth 0: the next verification decides alone
    gap: int = 0  # depth 0: steps between probes (doubles after a failed probe, capped)
    wait: int = 0  # depth 0: steps left before the next probe
    cap: int = 0  # the most drafts a row carries: k, or the request's own lower cap; 0: never drafts


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    want_logits: bool = False
    prefill_only: bool = False  # stop after the first token and hold the memory for a transfer
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    ended_seq: int = 0  # the scheduler's count of ended requests once this one ended (0: not ended)
    logits: object = None  # last-position logits when want_logits (a [vocab] float32 tensor)
    draft_token_ids: list[int] = field(default_factory=list)  # MTP drafts proposed for the next step
    spec: SpecDepth = field(default_factory=SpecDepth)  # draft depth, replaced whole by the policy
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token (params.logprobs)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)  # one per prompt token after the first
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache at first admission
    expected_hit: int | None = None  # while it waits: the prefix-cache hit it would get (serving/commands.py)
    # a record, not a state: admission once waited for a running request's snapshot
    # (engine/cache/inflight.py), counted once in the prefix stats
    held_back: bool = False
    block_hashes: list[int] | None = None  # prefix caching: chained hash of each full prompt page
    num_registered: int = 0  # pages of this request registered in the prefix cache
    snapshot_points: tuple[int, ...] = ()  # prefix caching: off-grid prompt positions to snapshot
    num_cached_blocks: int = 0  # decode side: leading prompt pages already here (not transferred)
    received: bool = False  # decode side: the prompt's state came from another node (Scheduler.reserve)
    short: bool = False  # its prompt counts against SchedulerConfig.short_step_tokens (set at admission)
    kv_transfer: object = None  # the caller's transfer parameters, read by the connector only (engine/connector.py)
    # images (docs/images.md): the prompt's images (on a decode node: their hashes and places, for
    # the prefix cache), its 3-D rotary positions ([3, len(prompt)] int64, where it is prefilled)
    # and the position offset of every token after the prompt (engine/vision/positions.py)
    images: tuple[ImageInput, ...] = ()
    mrope: object = None
    rope_delta: int = 0
    no_pixels: bool = False  # decode side: image placeholders but no pixels here (never recomputed)
    _hash_prompt: list[int] | None = None
    _status: Status = field(default=Status.WAITING, init=False)
    _sent: int = 0  # output tokens already reported to the caller
    _sent_logprobs: int = 0
    _sent_prompt_logprobs: bool = False

    @property
    def status(self) -> Status:
        return self._status

    def move(self, to: Status) -> None:
        """Change state; raises TransitionError on a move engine/request_state.py does not allow."""
        check_transition(self.request_id, self._status, to)
        self._status = to

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def hash_prompt(self) -> list[int]:
        """The prompt as the prefix cache names it: image placeholders carry their image's pixel
        hash (engine/vision/inputs.py `hash_view`), so different images never share pages, and a
        request with a `cache_salt` has its first token salted (engine/prefix_hash.py `salted`), so
        it shares pages only with requests of the same salt."""
        if self._hash_prompt is None:
            if not self.images and not self.params.cache_salt:
                return self.prompt_token_ids
            view = hash_view(self.prompt_token_ids, self.images) if self.images else self.prompt_token_ids
            self._hash_prompt = salted(view, self.params.cache_salt)
        return self._hash_prompt

    def hash_ids(self, start: int, end: int) -> list[int]:
        """`token_ids` as the prefix cache names them (`hash_prompt`)."""
        return _span(self.hash_prompt, self.output_token_ids, start, end)

    def rope_rows(self, start: int, end: int) -> list[list[int]] | None:
        """The 3-D rotary positions of tokens [start, end) as (t, h, w) lists, None for a request
        without images (positions are then start.. + rope_delta on every axis)."""
        if self.mrope is None:
            return None
        import torch

        table = self.mrope
        assert isinstance(table, torch.Tensor)
        p = table.shape[1]
        head = table[:, start : min(end, p)]
        if end > p:
            tail = torch.arange(max(start, p), end, dtype=torch.int64) + self.rope_delta
            head = torch.cat([head, tail.expand(3, -1)], dim=1)
        rows: list[list[int]] = head.tolist()
        return rows

    def token_ids(self, start: int, end: int) -> list[int]:
        return _span(self.prompt_token_ids, self.output_token_ids, start, end)


def _span(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """(prompt + output)[start:end] (0 <= start <= end) without joining the lists: a decode row's
    one token costs O(1), not O(context)."""
    p = len(prompt)
    if end <= p:
        return prompt[start:end]
    if start >= p:
        return output[start - p : end - p]
    return prompt[start:] + output[: end - p]
