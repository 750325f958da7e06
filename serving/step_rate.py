"""A node's own prefill rate: prompt tokens per second over its recent loop passes that computed
prompt tokens, each pass timed to the end of its transfer poll from the previous pass's end (or
from its wake-up after an idle wait). What the router's admission estimate divides the queued
prompt tokens by (docs/router.md, "Leases and admission").

Measured by the node, not from the completions the router sees: a prompt sent to an idle node
waits for its dispatch, its transfer and its first token's way back, none of which holds back a
busy node, and a client's one-at-a-time warm-up would otherwise measure half of a burst's rate."""

from __future__ import annotations

import time

from engine.rate_window import RateWindow

WINDOW = 32  # passes that prefilled


class StepRate(RateWindow):
    def __init__(self, window: int = WINDOW) -> None:
        super().__init__(window)
        self._mark = time.monotonic()  # when the last pass ended

    def passed(self, tokens: int, woke: float, busy: bool, now: float | None = None) -> None:
        """A pass ended: it computed `tokens` prompt tokens. It is timed from the previous pass's
        end when that one left work (`busy`: commands and the loop's own turn count), else from
        when it woke (`woke`: an idle wait is not the node's work; such a pass counts only from
        `IDLE_MIN_TOKENS` prompt tokens on, RateWindow.add)."""
        now = time.monotonic() if now is None else now
        self.add(tokens, now - (self._mark if busy else woke), idle=not busy)
        self._mark = now
