"""The persistent decode batch on the scheduler's side (docs/engine.md, "The persistent decode
batch"): the rows of a step whose every row was a plain decode row (one token past the prompt,
room for it in the request's pages, no drafts), kept so that the next step over the same running
list takes them again instead of planning each request."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

from engine.cache.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request
from engine.scheduler.output import ScheduledRow


class SteadyRows:
    def __init__(self) -> None:
        self._last: tuple[list[Request], list[ScheduledRow]] | None = None

    def keep(self, running: list[Request], rows: list[ScheduledRow] | None) -> None:
        """After a step's plan: its rows where all were plain decode rows (None: they were not)."""
        self._last = (list(running), rows) if rows else None

    def take(
        self,
        running: list[Request],
        waiting: Sequence[Request],
        cfg: SchedulerConfig,
        blocks: BlockManager,
        could_admit: Callable[[], bool],
    ) -> list[ScheduledRow] | None:
        """The last plan's rows, where `schedule` would plan them again and nothing else: the same
        running list, each request still a plain decode row, no waiting request that could start
        (`could_admit`, asked after this step's pages are taken, as `schedule` admits after the
        running rows). A row whose token opens a page gets that page here; where the pages are
        short, None (the general path preempts for them). None otherwise, and the rows are
        forgotten; pages taken by then stay with their rows, which the general path plans again."""
        last, self._last = self._last, None
        if last is None:
            return None
        before, rows = last
        if (
            len(running) != len(before)
            or len(rows) > cfg.max_num_batched_tokens
            or not all(map(operator.is_, running, before))
        ):
            return None
        bs = blocks.block_size
        opening = []  # requests whose token opens a page
        for r in rows:  # the plain row test of Scheduler._running_rows
            req = r.request
            done = req.num_computed_tokens
            if len(req.prompt_token_ids) + len(req.output_token_ids) - done != 1:
                return None
            if len(req.block_ids) * bs <= done:
                opening.append(req)
        if opening:
            if not blocks.can_allocate(len(opening)):
                return None
            for req in opening:
                req.block_ids += blocks.allocate(1)
        if waiting and len(running) < cfg.max_num_seqs and could_admit():
            return None
        self._last = last
        return rows
