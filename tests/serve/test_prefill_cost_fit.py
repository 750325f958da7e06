"""serving/step_rate.py's prefill cost fit against a known law, seconds = a x tokens + b x attended
pairs: windows of passes timed by it with a loaded host's noise (each pass 0.8x to 1.3x, about
one in ten stalled 2x to 8x) are priced within a bound of the law at every prompt length and
never below the window's fastest pass; any window's prices grow with a prompt's length; and the
router's price (router/wait_estimate.py node_rate) keeps to the floor the node reports."""

from __future__ import annotations

import random

import pytest

A, B = 2e-4, 4e-8  # the law: seconds a token, seconds a (token, context) pair
LENGTHS = (1, 16, 40, 300, 3000, 32000)


def _pairs(start: int, n: int) -> int:  # token i after `start` computed ones sees start + i + 1 positions
    return n * start + n * (n + 1) // 2


def _law(length: int) -> float:
    """Seconds a token of a prompt of `length` tokens computed from its start, under the law."""
    return A + B * (length + 1) / 2


def _price(cost, length: int) -> float:
    """Seconds a token the fitted cost asks, as the router prices it: the line, never under the floor."""
    a, b, *floor = cost
    return max([a + b * (length + 1) / 2, *floor])


def _window(rng: random.Random) -> list[tuple[int, int, float, float]]:
    """32 passes of a prefill node (tokens, pairs, seconds taken, seconds under the law): chunks of
    long prompts at contexts 0 to 32k and batches of short prompts from their start."""
    out = []
    for _ in range(32):
        if rng.random() < 0.3:
            n = 2048
            p = _pairs(rng.randrange(0, 16) * n, n)
        else:
            length = rng.choice([40, 100, 300])
            k = 2048 // length
            n, p = k * length, k * _pairs(0, length)
        law = A * n + B * p
        took = law * rng.uniform(0.8, 1.3)
        if rng.random() < 0.1:  # a load spike: the host's other work held the pass up
            took *= rng.uniform(2.0, 8.0)
        out.append((n, p, took, law))
    return out


def _fitted(window):
    from serving.step_rate import StepRate

    r, now = StepRate(), 0.0
    for i, (n, p, took, _) in enumerate(window):  # the first from idle, the rest each after the last
        now += took
        r.passed(n, woke=0.0, busy=i > 0, now=now, pairs=p)
    return r.cost()


def test_a_loaded_hosts_passes_are_priced_near_the_law_and_never_below_the_fastest():
    """Least squares on such windows swung between fits; in about one in ten its per-token term
    went negative, and clamped to 0 it priced a 40-token prompt 45 times (and a 1-token one a
    thousand times) faster than the law: admission then admitted requests that started late.
    Now every length is priced at least 0.75x the law, at most 2.5x the law times the window's
    own slowdown (its seconds over the law's: the stalls are time the queue waits too), and
    never below the fastest pass of the window."""
    rng = random.Random(1234)
    for _ in range(300):
        window = _window(rng)
        cost = _fitted(window)
        slowdown = sum(w[2] for w in window) / sum(w[3] for w in window)
        fastest = min(took / n for n, _, took, _ in window)
        for length in LENGTHS:
            price = _price(cost, length)
            assert price >= 0.75 * _law(length), (length, price / _law(length), cost)
            assert price <= 2.5 * slowdown * _law(length), (length, price / _law(length), slowdown, cost)
            assert price >= fastest * (1 - 1e-12), (length, price, fastest, cost)


def test_a_clean_window_gives_the_law_back_and_a_stalled_pass_moves_only_the_level():
    """Exact passes of short batches and long chunks: the law itself (the floor, the fastest pass,
    below every price). One pass stalled 20x: the split keeps the law's shape (the 32k prompt's
    token still costs what the law's does relative to a 40-token one) and the level rises by the
    window's own slowdown, so the fit prices the window's passes at the seconds they took."""
    rng = random.Random(7)
    window = [(n, p, law, law) for n, p, _, law in _window(rng)]
    cost = _fitted(window)
    assert cost[:2] == (pytest.approx(A, rel=1e-9), pytest.approx(B, rel=1e-9))
    stalled = [(n, p, law * (20.0 if i == 5 else 1.0), law) for i, (n, p, _, law) in enumerate(window)]
    cost = _fitted(stalled)
    slowdown = sum(w[2] for w in stalled) / sum(w[3] for w in stalled)
    assert cost[0] == pytest.approx(A * slowdown, rel=1e-9) and cost[1] == pytest.approx(B * slowdown, rel=1e-9)
    took = sum(cost[0] * n + cost[1] * p for n, p, _, _ in stalled)
    assert took == pytest.approx(sum(w[2] for w in stalled), rel=1e-9)


def test_prices_never_fall_as_a_prompt_grows():
    """Any window, however odd (random tokens, contexts and seconds over four decades): both terms
    >= 0, so a token of a longer prompt never costs less, and a longer prompt takes longer."""
    from serving.step_rate import fit

    rng = random.Random(99)
    lengths = sorted({1, 2, 3, *(rng.randrange(1, 200_000) for _ in range(60))})
    for _ in range(300):
        window = []
        for _ in range(rng.randrange(1, 33)):
            n = rng.randrange(1, 4097)
            p = _pairs(rng.randrange(0, 65536), n)
            window.append((n, p, n * 10 ** rng.uniform(-6, -2)))
        cost = fit(window)
        assert cost is not None and cost.per_token >= 0 and cost.per_pair >= 0
        assert cost.fastest == min(s / n for n, _, s in window)
        per_token = [cost.per_token_at(n) for n in lengths]
        assert per_token == sorted(per_token)
        total = [n * t for n, t in zip(lengths, per_token, strict=True)]
        assert all(x < y for x, y in zip(total, total[1:], strict=False))
        assert min(per_token) >= cost.fastest


def test_the_router_never_prices_a_token_below_the_nodes_fastest():
    """A cost whose line asks little of a short prompt (its pairs term carries the time) is priced by
    the router at the node's fastest pass, not at the line; a long prompt at the line above it."""
    from proto import pb
    from router.registry import NodeEntry
    from router.wait_estimate import NODE_RATE_MARGIN, RateMeter, node_rate

    a, b, fastest = 0.0, 1e-7, 2e-4
    e = NodeEntry(pb.NodeInfo(node_id="p", kind=pb.NODE_KIND_PREFILL))
    e.info.prefill_cost.CopyFrom(pb.PrefillCost(s_per_token=a, s_per_pair=b, s_per_token_min=fastest))
    m = RateMeter()
    assert node_rate(e, m, 40) == pytest.approx(NODE_RATE_MARGIN / fastest)  # the line says 2.05e-6 s
    assert node_rate(e, m, 30_000) == pytest.approx(NODE_RATE_MARGIN / (b * 30_001 / 2))
    e.info.prefill_cost.s_per_token_min = 0.0  # a node that sends no floor: the line alone
    assert node_rate(e, m, 40) == pytest.approx(NODE_RATE_MARGIN / (b * 41 / 2))
