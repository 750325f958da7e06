"""A rate over a sliding window of (amount, seconds) samples: the window's amount over its
seconds, so a sample of 0 s counts against the others and one odd interval moves the rate by
1/window, not as much as a moving average would. The scheduler's prompt rate
(engine/scheduler/priority.py), a node's own prefill rate (serving/step_rate.py) and the
router's per-node meter (router/wait_estimate.py) are all one of these."""

from __future__ import annotations

from collections import deque

# A prompt computed by an idle node measures its rate from this length on: a shorter one (a client's
# warm-up, a health check) measures the fixed cost of a pass, not tokens per second, and taken as
# the rate it would make admission refuse the first real burst.
IDLE_MIN_TOKENS = 256


def attended_pairs(row) -> int:
    """(token, context) pairs of a prompt row's new tokens: token i after `start` computed ones sees
    start + i + 1 positions, so attention's work is n start + n (n + 1) / 2 (proto PrefillCost)."""
    n, start = row.num_new_tokens, row.request.num_computed_tokens
    return n * start + n * (n + 1) // 2


class RateWindow:
    def __init__(self, window: int) -> None:
        self._seen: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, amount: int, seconds: float, idle: bool = False) -> bool:
        """One sample, and whether it counts: none of anything (amount <= 0) does not, nor one
        taken from idle (`idle`: a lone prompt on an idle node) of fewer than IDLE_MIN_TOKENS."""
        if amount > 0 and not (idle and amount < IDLE_MIN_TOKENS):
            self._seen.append((amount, max(seconds, 0.0)))
            return True
        return False

    def rate(self) -> float | None:
        """Amount per second over the window; None before the first sample."""
        if not self._seen:
            return None
        return sum(a for a, _ in self._seen) / max(sum(s for _, s in self._seen), 1e-9)
