"""Scheduling classes (SamplingParams.priority: 0 interactive, 1 batch): the waiting and running
lists are kept in class order, and `Classes` decides how many prompt tokens batch requests get in
a step. While interactive requests are about (one waits or runs, or one arrived in the last
`RECENT_S`), batch prompt chunks get at most `batch_chunk_tokens` a step, so the step an
interactive prompt may find in flight is short, and none in a step that computes an interactive
prompt chunk; with no interactive request about, batch prompts take whole steps."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, MutableSequence

from engine.config import SchedulerConfig
from engine.request import Request

INTERACTIVE, BATCH = 0, 1
RECENT_S = 10.0  # an interactive request arrived this recently: batch chunks stay short


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

    def arrived(self, req: Request) -> None:
        if req.params.priority == INTERACTIVE:
            self.last_interactive = time.monotonic()

    def batch_allowance(self, running: Iterable[Request], waiting: Iterable[Request], cfg: SchedulerConfig) -> int:
        """Prompt tokens batch requests may compute in the next step (before the no-chunk rule)."""
        now = time.monotonic()
        if any(r.params.priority == INTERACTIVE for q in (running, waiting) for r in q):
            self.last_interactive = now
        if cfg.batch_chunk_tokens and now - self.last_interactive < RECENT_S:
            return cfg.batch_chunk_tokens
        return cfg.max_num_batched_tokens
