"""A node's own prefill rate: prompt tokens per second over its recent loop passes that computed
prompt tokens, each pass timed to the end of its transfer poll from the previous pass's end (or
from its wake-up after an idle wait). What the router's admission estimate divides the queued
prompt tokens by (docs/router.md, "Leases and admission").

Measured by the node, not from the completions the router sees: a prompt sent to an idle node
waits for its dispatch, its transfer and its first token's way back, none of which holds back a
busy node, and a client's one-at-a-time warm-up would otherwise measure half of a burst's rate.

`cost()` fits the same passes as seconds = a x tokens + b x attended (token, context) pairs
(proto PrefillCost): a long prompt's later chunks run slower as its context grows, and priced at
its window rate the short prompts after it looked slow (3,000-token prompts estimated at 2,283
tokens/s after a 32k prompt, served at 5,760 in a burst; 76 of 100 refused)."""

from __future__ import annotations

import time
from collections import deque

from engine.rate_window import RateWindow

WINDOW = 32  # passes that prefilled
# the fit's pairs term is kept only when the passes' mean contexts spread this much (max / min):
# passes alike in context cannot tell the two terms apart, and one rate prices them as well
SPREAD_MIN = 2.0


class StepRate(RateWindow):
    def __init__(self, window: int = WINDOW) -> None:
        super().__init__(window)
        self._mark = time.monotonic()  # when the last pass ended
        self._fit: deque[tuple[int, int, float]] = deque(maxlen=window)  # (tokens, pairs, seconds)

    def passed(self, tokens: int, woke: float, busy: bool, now: float | None = None, pairs: int = 0) -> None:
        """A pass ended: it computed `tokens` prompt tokens (`pairs`: their attended pairs). It is
        timed from the previous pass's end when that one left work (`busy`: commands and the
        loop's own turn count), else from when it woke (`woke`: an idle wait is not the node's
        work; such a pass counts only from `IDLE_MIN_TOKENS` prompt tokens on, RateWindow.add)."""
        now = time.monotonic() if now is None else now
        seconds = max(now - (self._mark if busy else woke), 0.0)
        if self.add(tokens, seconds, idle=not busy):
            self._fit.append((tokens, max(pairs, tokens), seconds))
        self._mark = now

    def cost(self) -> tuple[float, float] | None:
        """(seconds per token, seconds per pair) over the window by least squares, both >= 0; the
        pairs term 0 where the passes' mean contexts hardly differ; None before the first pass."""
        if not self._fit:
            return None
        n, p, s = ([float(x[k]) for x in self._fit] for k in range(3))
        plain = (sum(s) / sum(n), 0.0)
        ctx = [q / t for t, q in zip(n, p, strict=True)]
        if max(ctx) < SPREAD_MIN * min(ctx):
            return plain
        nn, np_, pp = (sum(x * y for x, y in zip(u, v, strict=True)) for u, v in ((n, n), (n, p), (p, p)))
        ns, ps = (sum(x * y for x, y in zip(u, s, strict=True)) for u in (n, p))
        det = nn * pp - np_ * np_
        if det <= 1e-9 * nn * pp:
            return plain
        a, b = (ns * pp - ps * np_) / det, (ps * nn - ns * np_) / det
        if b <= 0:
            return plain
        return (a, b) if a >= 0 else (0.0, ps / pp)
