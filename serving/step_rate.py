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
tokens/s after a 32k prompt, served at 5,760 in a burst; 76 of 100 refused).

How it is fitted. Per token a pass costs a + b x its mean context (pairs / tokens): a line in
(context, seconds per token). Least squares on the passes' seconds was unstable on a loaded host:
the two terms are nearly collinear when contexts spread little, one slow pass swung the split,
and a negative a, clamped to a = 0 with b taking all the time, priced short prompts by their
tiny pair count, 27x faster than the node ran them (admission then admitted requests that
started past their budget). Now:
- b, the slope, is the weighted median of the slopes between pairs of passes whose contexts
  differ at least `SPREAD_MIN` times (Theil-Sen, weighted as Sievers's): a load spike moves one
  pass, so it moves only the slopes through it, and a median of them not at all while most are
  clean. A pair weighs its two passes' tokens (a short pass's fixed cost is per pass) times the
  distance of their contexts: between a 20- and a 150-token prompt the pairs term is 3% of a
  token's time, well inside a pass's noise, and a window of mostly short prompts outvoted its
  two long chunks. No such pair, or a median below 0: b = 0.
- a, the level, prices the window's own passes at the seconds they took, (sum seconds - b sum
  pairs) / sum tokens (at most all of them: b <= sum seconds / sum pairs keeps a >= 0). It is not
  robust on purpose: admission asks how long a queue takes to drain, which is the sum of the
  passes, stalls included, so the fit and the window's rate agree on the window's own mix.
- `fastest`, the least seconds per token of any pass in the window, is sent with them: the router
  never prices a prompt below it (PrefillCost.s_per_token_min), so no split of the terms can
  claim a speed the node did not show. Extrapolated below the shortest context seen, the line
  alone may go under it; the floor holds there."""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

from engine.rate_window import RateWindow

WINDOW = 32  # passes that prefilled
# the fit's pairs term is kept only when some passes' mean contexts spread this much (max / min):
# passes alike in context cannot tell the two terms apart, and one rate prices them as well
SPREAD_MIN = 2.0


class Cost(NamedTuple):
    """A fitted prefill cost (proto PrefillCost): seconds a token, a (token, context) pair, and the
    least seconds a token of any pass in the window (the floor of any price)."""

    per_token: float
    per_pair: float
    fastest: float

    def per_token_at(self, length: int) -> float:
        """Seconds a token of a prompt of `length` tokens computed from its start (its tokens see
        (length + 1) / 2 positions on average), never below `fastest`: nondecreasing in length."""
        return max(self.fastest, self.per_token + self.per_pair * (length + 1) / 2)


def weighted_median(items: list[tuple[float, float]]) -> float:
    """The value at half the total weight of (value, weight) items (weights > 0, items not empty)."""
    items = sorted(items)
    half, acc = sum(w for _, w in items) / 2, 0.0
    for v, w in items:
        acc += w
        if acc >= half:
            return v
    return items[-1][0]


def fit(passes: list[tuple[int, int, float]]) -> Cost | None:
    """The cost of (tokens, pairs, seconds) passes (module docstring); None without a pass."""
    passes = [x for x in passes if x[0] > 0]
    if not passes:
        return None
    tokens, pairs, seconds = (sum(float(x[k]) for x in passes) for k in range(3))
    pts = [(q / n, s / n, float(n)) for n, q, s in passes]  # (context, seconds a token, weight)
    fastest = min(y for _, y, _ in pts)
    slopes = [
        ((y2 - y1) / (x2 - x1), w1 * w2 * abs(x2 - x1))
        for i, (x1, y1, w1) in enumerate(pts)
        for x2, y2, w2 in pts[i + 1 :]
        if max(x1, x2) >= SPREAD_MIN * min(x1, x2)
    ]
    b = max(weighted_median(slopes), 0.0) if slopes else 0.0
    a = max(weighted_median([(y - b * x, w) for x, y, w in pts]), 0.0)
    line = a * tokens + b * pairs
    if line <= 0.0:  # every pass took no time
        return Cost(0.0, 0.0, fastest)
    level = seconds / line  # the window's own passes priced at the seconds they took
    return Cost(a * level, b * level, fastest)


class StepRate(RateWindow):
    def __init__(self, window: int = WINDOW) -> None:
        super().__init__(window)
        self._mark = time.monotonic()  # when the last pass ended
        self._fit: deque[tuple[int, int, float]] = deque(maxlen=window)  # (tokens, pairs, seconds)
        self._cost: Cost | None = None  # fit(self._fit), kept until a pass is added
        self._stale = False

    def passed(self, tokens: int, woke: float, busy: bool, now: float | None = None, pairs: int = 0) -> None:
        """A pass ended: it computed `tokens` prompt tokens (`pairs`: their attended pairs). It is
        timed from the previous pass's end when that one left work (`busy`: commands and the
        loop's own turn count), else from when it woke (`woke`: an idle wait is not the node's
        work; such a pass counts only from `IDLE_MIN_TOKENS` prompt tokens on, RateWindow.add)."""
        now = time.monotonic() if now is None else now
        seconds = max(now - (self._mark if busy else woke), 0.0)
        if self.add(tokens, seconds, idle=not busy):
            self._fit.append((tokens, max(pairs, tokens), seconds))
            self._stale = True
        self._mark = now

    def cost(self) -> Cost | None:
        """The window's fitted cost (module docstring; both terms >= 0, the pairs term 0 where no
        two passes' mean contexts differ `SPREAD_MIN` times); None before the first pass. Refitted
        only after a pass was added (the loop asks after every pass)."""
        if self._stale:
            self._cost, self._stale = fit(list(self._fit)), False
        return self._cost
