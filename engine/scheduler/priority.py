"""Scheduling classes (SamplingParams.priority: 0 interactive, 1 batch): the waiting and running
lists are kept in class order, and `Classes` decides how many prompt tokens batch requests get in
a step. While interactive requests are about (one waits or runs, or one arrived in the last
`RECENT_S`), batch prompt chunks get at most `batch_chunk_tokens` a step, and no more than the
node computes in `batch_step_s` at the prompt rate of its last steps without decode rows (a
model and a machine on which 256 tokens take 30 ms hold an interactive prompt that long; none
measured yet: `batch_chunk_tokens` alone), so the step an interactive
prompt may find in flight is short, and none in a step that computes an interactive prompt
chunk; with no interactive request about, batch prompts take whole steps."""

from __future__ import annotations

import math
import time
from collections.abc import MutableSequence, Sequence

from engine.config import SchedulerConfig
from engine.rate_window import RateWindow
from engine.request import Request

INTERACTIVE, BATCH = 0, 1
RECENT_S = 10.0  # an interactive request arrived this recently: batch chunks stay short
MIN_BATCH_CHUNK = 16  # the fewest prompt tokens a batch chunk is cut to by time
RATE_STEPS = 8  # the steps with prompt tokens the rate is taken over


def insert(queue: MutableSequence[Request], req: Request, front: bool = False) -> None:
    """Put `req` at the end (or the front, `front`) of its class in a class-ordered list."""
    cls = req.params.priority
    at = len(queue)
    for i, r in enumerate(queue):
        if r.params.priority > cls or (front and r.params.priority == cls):
            at = i
            break
    queue.insert(at, req)


class Classes:
    """When the last interactive request was seen (arrived, waiting or running)."""

    def __init__(self) -> None:
        self.last_interactive = -math.inf
        self.prompt_rate = RateWindow(RATE_STEPS)  # prompt tokens per second of steps without decode rows

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """A step without decode rows ran: the prompt tokens it computed and how long it took."""
        self.prompt_rate.add(prompt_tokens, seconds)

    def arrived(self, req: Request) -> None:
        if req.params.priority == INTERACTIVE:
            self.last_interactive = time.monotonic()

    def batch_allowance(self, running: Sequence[Request], waiting: Sequence[Request], cfg: SchedulerConfig) -> int:
        """Prompt tokens batch requests may compute in the next step (before the no-chunk rule).
        Both lists are in class order: an interactive request in one is at its front."""
        now = time.monotonic()
        if any(q and q[0].params.priority == INTERACTIVE for q in (running, waiting)):
            self.last_interactive = now
        if now - self.last_interactive >= RECENT_S:
            return cfg.max_num_batched_tokens
        cap = cfg.batch_chunk_tokens or cfg.max_num_batched_tokens
        rate = self.prompt_rate.rate() if cfg.batch_step_s else None
        if rate is not None:  # at least a few tokens a step: batch requests still move
            cap = min(cap, max(MIN_BATCH_CHUNK, int(rate * cfg.batch_step_s)))
        return cap
