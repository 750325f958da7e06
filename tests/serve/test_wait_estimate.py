"""router/wait_estimate.py's `estimate` against hand-computed sums: the prompts ahead priced at
the prefill node's fitted cost (each at its own length, however mixed), a prompt under way counted
for what is left of it, and a request that takes no decode node waiting for the pool alone."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.admission import BATCH, Admission, Ask
from router.wait_estimate import RateMeter


async def _queued(adm: Admission, n: int) -> None:
    while adm.depth() != n:
        await asyncio.sleep(0.002)


def _never():
    return None


def test_prompts_ahead_are_priced_at_their_own_length():
    """After a long prompt a node's window rate is its long chunks' rate; with its fitted cost
    the estimate prices a burst of short prompts at their own cost (a + b (n + 1) / 2 a token,
    computed here by hand), and a long prompt among them at its own: the sum of each prompt's."""
    from proto import pb
    from router.registry import NodeRegistry
    from router.wait_estimate import NODE_RATE_MARGIN, estimate

    reg = NodeRegistry()
    cap = pb.Capacity(total_blocks=10**6, free_blocks=10**6, block_size=16, total_slots=512, free_slots=512)
    reg.register(pb.NodeInfo(node_id="d", kind=pb.NODE_KIND_DECODE, capacity=cap))
    a, b = 2e-4, 4e-8
    p = reg.register(
        pb.NodeInfo(
            node_id="p",
            kind=pb.NODE_KIND_PREFILL,
            prefill_ready=True,
            prefill_tokens_per_s=1000.0,
            prefill_cost=pb.PrefillCost(s_per_token=a, s_per_pair=b),
        )
    )
    m = RateMeter()
    burst = dict(ahead_tokens=20 * 3000, ahead=20, ahead_squares=20 * 3000**2)
    est, what = estimate(reg, m, 3000, 3000, **burst, ends=[], batch=True)
    assert est == pytest.approx(20 * 3000 * (a + b * 3001 / 2) / NODE_RATE_MARGIN, rel=1e-6), what
    assert est < 20 * 3000 / (1000.0 * NODE_RATE_MARGIN) / 2  # the window rate says over twice as long
    p.prefill_sent(30000, interactive=False)  # one long prompt ahead as well, at its own cost
    est, _ = estimate(reg, m, 3000, 3000, **burst, ends=[], batch=True)
    took = sum(n * (a + b * (n + 1) / 2) for n in [30000] + [3000] * 20)
    assert est == pytest.approx(took / NODE_RATE_MARGIN, rel=1e-4)


async def _mixed_queue_estimate():
    from proto import pb
    from router.registry import NodeRegistry
    from router.wait_estimate import NODE_RATE_MARGIN, estimate

    reg = NodeRegistry()
    cap = pb.Capacity(total_blocks=10**6, free_blocks=10**6, block_size=16, total_slots=512, free_slots=512)
    reg.register(pb.NodeInfo(node_id="d", kind=pb.NODE_KIND_DECODE, capacity=cap))
    a, b = 1e-5, 2e-7  # attention-heavy: a token of a 1,500-token prompt costs 11 of a 40-token one
    cost = pb.PrefillCost(s_per_token=a, s_per_pair=b)
    p = reg.register(pb.NodeInfo(node_id="p", kind=pb.NODE_KIND_PREFILL, prefill_ready=True, prefill_cost=cost))
    lens = [1500 if i % 10 == 0 else 40 for i in range(60)]
    for n in lens[:3]:  # three of them sent to the node already, the rest queued in the router
        p.prefill_sent(n, interactive=False)
    adm = Admission(max_queued=0)
    tasks = [asyncio.create_task(adm.wait(Ask(BATCH, tokens=n), _never, _never)) for n in lens[3:]]
    await _queued(adm, len(tasks))
    est, what = estimate(reg, RateMeter(), 40, 40, *adm.ahead(BATCH), ends=[], batch=True)
    took = sum(n * (a + b * (n + 1) / 2) for n in lens)  # each prompt's own time, one by one
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert adm.ahead(BATCH) == (0, 0, 0)
    for n in lens[:3]:
        p.prefill_back(n, interactive=False)
    assert p.inflight_prefill_tokens == p.inflight_prefill_squares == 0
    return est, what, took / NODE_RATE_MARGIN


def test_prompts_of_mixed_lengths_ahead_are_each_priced_at_their_own():
    """A burst of 40-token prompts with a 1,500-token one in ten, partly sent to the prefill node
    and partly queued in the router: the estimate is the sum of each prompt's time at the node's
    fitted cost (their plain mean length priced them at over 4 times the rate they run at), and
    every counter is back at 0 once they have left."""
    est, what, want = asyncio.run(_mixed_queue_estimate())
    assert est == pytest.approx(want, rel=1e-3), what


def test_a_prompt_under_way_counts_what_is_left_of_it():
    """The router counts a prompt in full until its first token comes back; the estimate takes off
    what the node computed since its last completion, so a request arriving while a long prompt
    is half done waits for the other half, not the whole. Counted against an independent sum:
    the tokens ahead over the node's rate, less the node's rate times the seconds it has worked."""
    from proto import pb
    from router.registry import NodeRegistry
    from router.wait_estimate import NODE_RATE_MARGIN, estimate

    reg = NodeRegistry()
    cap = pb.Capacity(total_blocks=1000, free_blocks=1000, block_size=16, total_slots=64, free_slots=64)
    reg.register(pb.NodeInfo(node_id="d", kind=pb.NODE_KIND_DECODE, capacity=cap))
    p = reg.register(
        pb.NodeInfo(node_id="p", kind=pb.NODE_KIND_PREFILL, prefill_ready=True, prefill_tokens_per_s=1000.0)
    )
    rate = 1000.0 * NODE_RATE_MARGIN
    m = RateMeter()
    m.busy("p", now=time.monotonic() - 2.0)  # sent an 8000-token prompt 2 s ago, idle before it
    p.prefill_sent(8000, interactive=True)
    est, what = estimate(reg, m, 100, 100, ahead_tokens=500, ahead=1, ahead_squares=500**2, ends=[])
    assert est == pytest.approx((8000 - 2.0 * rate + 500) / rate, rel=0.01), what
    m.done("p", 8000)  # it came back, and another prompt went in its place just now
    p.prefill_back(8000, interactive=True)
    p.prefill_sent(3000, interactive=True)
    est, _ = estimate(reg, m, 100, 100, ahead_tokens=0, ahead=0, ahead_squares=0, ends=[])
    assert est == pytest.approx(3000 / rate, rel=0.01)
    m.busy("p", now=time.monotonic() - 60.0)  # a node slower than its rate: never less than nothing
    est, _ = estimate(reg, m, 100, 100, ahead_tokens=200, ahead=0, ahead_squares=200**2, ends=[])
    assert est == pytest.approx(200 / rate, rel=0.01)


def test_a_request_ending_at_its_first_token_waits_for_the_pool_only():
    """With no decode room (every slot held, ends far off), a request that takes no decode node
    (decode=False: it ends at its first token) is estimated at the prefill pool's turn alone."""
    from proto import pb
    from router.registry import NodeRegistry
    from router.wait_estimate import NODE_RATE_MARGIN, estimate

    reg = NodeRegistry()
    full = pb.Capacity(total_blocks=1000, free_blocks=1000, block_size=16, total_slots=4, free_slots=0)
    reg.register(pb.NodeInfo(node_id="d", kind=pb.NODE_KIND_DECODE, capacity=full))
    reg.register(pb.NodeInfo(node_id="p", kind=pb.NODE_KIND_PREFILL, prefill_ready=True, prefill_tokens_per_s=1000.0))
    m = RateMeter()
    held, _ = estimate(reg, m, 100, 100, ahead_tokens=400, ahead=0, ahead_squares=400**2, ends=[50.0] * 4)
    alone, what = estimate(
        reg, m, 100, 100, ahead_tokens=400, ahead=0, ahead_squares=400**2, ends=[50.0] * 4, decode=False
    )
    assert held == pytest.approx(50.0)
    assert alone == pytest.approx(400 / (1000.0 * NODE_RATE_MARGIN), rel=0.01), what


def test_an_interactive_request_prices_only_the_interactive_prompts_ahead():
    """A batch flood of 8,000-token prompts sent to the prefill node, and 100-token interactive
    ones (one sent, five queued): the node computes the interactive ones first, and an interactive
    arrival's estimate is their own time at the fitted cost, the flood's lengths left out (priced
    at the mix's length-weighted mean, 7,854 tokens, they would cost 40 times as much a token)."""
    from proto import pb
    from router.registry import NodeRegistry
    from router.wait_estimate import NODE_RATE_MARGIN, estimate

    reg = NodeRegistry()
    cap = pb.Capacity(total_blocks=10**6, free_blocks=10**6, block_size=16, total_slots=512, free_slots=512)
    reg.register(pb.NodeInfo(node_id="d", kind=pb.NODE_KIND_DECODE, capacity=cap))
    a, b = 1e-5, 2e-7
    cost = pb.PrefillCost(s_per_token=a, s_per_pair=b)
    p = reg.register(pb.NodeInfo(node_id="p", kind=pb.NODE_KIND_PREFILL, prefill_ready=True, prefill_cost=cost))
    for _ in range(4):
        p.prefill_sent(8000, interactive=False)
    p.prefill_sent(100, interactive=True)
    est, what = estimate(reg, RateMeter(), 100, 100, 500, 5, 5 * 100**2, ends=[])
    assert est == pytest.approx(6 * 100 * (a + b * 101 / 2) / NODE_RATE_MARGIN, rel=1e-6), what
    for _ in range(4):
        p.prefill_back(8000, interactive=False)
    p.prefill_back(100, interactive=True)
    assert p.inflight_prefill_squares == p.inflight_interactive_squares == 0
