"""router/admission.py and router/wait_estimate.py in-process on an event loop: FIFO order within
a tenant, the queue limit, refusal at arrival on the estimate (never later), a client leaving
the queue (its task cancelled), interactive before batch, API keys taking turns, and the rate
meter against a hand-computed sequence; each with the outcome the router's metrics see."""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import pytest

from router.admission import BATCH, INTERACTIVE, Admission, Ask, Refused
from router.errors import Abort
from router.wait_estimate import RateMeter


class _Room:
    """place() functions over a shared count of free places, recording who got one, in order."""

    def __init__(self):
        self.n = 0
        self.order: list[str] = []

    def place(self, name: str):
        def fn():
            if self.n > 0:
                self.n -= 1
                self.order.append(name)
                return name
            return None

        return fn


async def _queued(adm: Admission, n: int) -> None:
    while adm.depth() != n:
        await asyncio.sleep(0.002)


def _never():
    return None


async def _fifo_limit_estimate_cancel():
    left = []
    adm = Admission(max_queued=3, on_leave=lambda o, ask, w: left.append(o))
    room = _Room()
    ask = Ask(budget_s=0.5)
    tasks = []
    for i in range(3):  # arrive in order 0, 1, 2
        adm.decide(ask, 0.1, "test")
        tasks.append(asyncio.create_task(adm.wait(ask, room.place(str(i)), _never)))
        await _queued(adm, i + 1)
    with pytest.raises(Refused) as ei:  # a fourth finds the queue full: refused at once
        adm.decide(ask, 0.0, "test")
    assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "already wait" in ei.value.msg
    assert ei.value.retry_after_s == 1.0  # nothing known of when it drains: in a second
    with pytest.raises(Refused) as ei:  # the queue ahead takes 12.3 s to start: come back then
        adm.decide(Ask(budget_s=0.0), 12.3, "test")
    assert ei.value.retry_after_s == 12.3 and "in about 12 s" in ei.value.msg, ei.value.msg
    with pytest.raises(Refused) as ei:
        adm.decide(ask, math.inf, "test")
    assert ei.value.retry_after_s == 1.0
    adm.decide(Ask(resumed=True), math.inf, "test")  # a resumed request is never refused
    t = time.monotonic()
    tasks[1].cancel()  # the middle one leaves at once
    await asyncio.gather(tasks[1], return_exceptions=True)
    assert time.monotonic() - t < 0.5 and adm.depth() == 2
    await asyncio.sleep(0.8)  # past the budget: no late refusal, they still wait
    assert not tasks[0].done() and not tasks[2].done()
    room.n = 1  # room for one: the head (0) gets it, never 2
    adm.wake()
    assert await asyncio.wait_for(tasks[0], 2) == "0" and adm.depth() == 1
    room.n = 1
    adm.wake()
    assert await asyncio.wait_for(tasks[2], 2) == "2" and adm.depth() == 0
    # the estimate past the budget: refused at arrival with the estimate to retry after
    with pytest.raises(Refused) as ei:
        adm.decide(Ask(budget_s=2.0), 3.5, "7,000 prompt tokens ahead at 2,000 tokens/s")
    assert ei.value.retry_after_s == 3.5 and "about 3.5 s" in ei.value.msg and "2,000 tokens/s" in ei.value.msg
    adm.decide(Ask(budget_s=0.0), 1e9, "test")  # budget 0: waits as long as it takes
    with pytest.raises(Refused) as ei:  # no decode room: the budget is the hint
        adm.decide(Ask(budget_s=2.0), math.inf, "no room")
    assert ei.value.retry_after_s == 2.0
    assert sorted(left) == ["admitted", "admitted", "cancelled", "estimate", "estimate"] + ["queue_full"] * 3


def test_fifo_limit_estimate_and_cancel():
    asyncio.run(_fifo_limit_estimate_cancel())


async def _unavailable_after_budget():
    adm = Admission(max_queued=0)
    t0 = time.monotonic()
    err = Abort(grpc.StatusCode.UNAVAILABLE, "no live decode node takes new requests")
    with pytest.raises(Abort) as ei:
        await adm.wait(Ask(budget_s=0.3), lambda: None, lambda: err)
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE and 0.3 <= time.monotonic() - t0 < 2


def test_no_node_at_all_is_unavailable_after_the_budget():
    asyncio.run(_unavailable_after_budget())


async def _classes_and_turns():
    adm = Admission(max_queued=0)
    room = _Room()
    tasks = []

    async def arrive(name: str, ask: Ask) -> None:
        tasks.append(asyncio.create_task(adm.wait(ask, room.place(name), _never)))
        await _queued(adm, len(tasks))

    for i in range(4):  # a batch flood from key A, then from key B
        await arrive(f"bA{i}", Ask(BATCH, "A"))
    for i in range(2):
        await arrive(f"bB{i}", Ask(BATCH, "B"))
    for i in range(3):  # interactive ones sent after it, key A thrice then key B once
        await arrive(f"iA{i}", Ask(INTERACTIVE, "A", tokens=10))
    await arrive("iB0", Ask(INTERACTIVE, "B", tokens=10))
    assert adm.ahead(INTERACTIVE) == (40, 4, 400) and adm.ahead(BATCH) == (40, 10, 400)
    for _ in range(len(tasks)):
        room.n = 1
        adm.wake()
        while room.n:
            await asyncio.sleep(0.002)
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    # interactive first; within a class, the keys take turns, each key in its own arrival order
    assert room.order == ["iA0", "iB0", "iA1", "iA2", "bA0", "bB0", "bA1", "bB1", "bA2", "bA3"]


def test_interactive_before_batch_and_keys_take_turns():
    asyncio.run(_classes_and_turns())


async def _limit_by_class():
    adm = Admission(max_queued=3)
    tasks = []

    async def arrive(ask: Ask) -> None:
        adm.decide(ask, 0.0, "test")
        tasks.append(asyncio.create_task(adm.wait(ask, _never, _never)))
        await _queued(adm, len(tasks))

    for _ in range(3):  # a batch flood fills the queue
        await arrive(Ask(BATCH))
    for _ in range(3):  # interactive ones start before all of it: queued up to the limit of their own
        await arrive(Ask(INTERACTIVE))
    with pytest.raises(Refused) as ei:  # another batch request finds it full
        adm.decide(Ask(BATCH), 0.0, "test")
    assert "6 requests that start before this batch one" in ei.value.msg, ei.value.msg
    with pytest.raises(Refused) as ei:
        adm.decide(Ask(INTERACTIVE), 0.0, "test")
    assert "3 requests that start before this interactive one" in ei.value.msg, ei.value.msg
    assert adm.depth() == 6
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert adm.depth() == 0


def test_the_queue_limit_counts_the_requests_that_start_first():
    """A batch flood that fills --max-queued-requests does not refuse interactive requests, which
    would start before every batch one: each class is refused at the limit counted over itself and
    the classes before it."""
    asyncio.run(_limit_by_class())


def test_rate_meter_over_its_last_completions():
    from router.wait_estimate import WINDOW

    m = RateMeter()
    assert m.rate("p") is None
    m.busy("p", now=0.0)  # a client's sequential warm-up: round trips from idle, not counted
    m.done("p", 16, now=0.15)
    m.busy("p", now=0.2)
    m.done("p", 16, now=0.35)
    assert m.rate("p") is None
    m.busy("p", now=10.0)
    m.done("p", 100, now=10.2)  # a short prompt to an idle node: not counted
    m.done("p", 3000, now=11.0)  # busy since: 3000 tokens in 0.8 s
    assert m.rate("p") == pytest.approx(3750.0)
    m.done("p", 3000, now=11.0)  # finished in the same step: its tokens count against that second
    assert m.rate("p") == pytest.approx(7500.0)
    m.busy("p", now=20.0)  # idle in between: a long prompt measures from when it went busy
    m.done("p", 1000, now=20.5)
    m.done("p", 1000, now=21.0)
    assert m.rate("p") == pytest.approx(8000 / 1.8)
    for k in range(WINDOW):  # the window holds the last WINDOW completions only
        m.done("p", 100, now=22.0 + k)  # 1 s apart
    assert m.rate("p") == pytest.approx(100.0)


def test_decode_wait_from_the_placed_requests_ends():
    from router.wait_estimate import decode_wait

    assert decode_wait(1, [3.0, 1.0, 2.0]) == 1.0  # the soonest end frees the first place
    assert decode_wait(3, [3.0, 1.0, 2.0]) == 3.0
    assert decode_wait(4, [3.0, 1.0, 2.0]) == 1.0 + 3.0  # a second round: a turn of the longest more
    assert decode_wait(1, []) == math.inf  # nothing placed, no room: no end in sight


def test_step_rate_counts_only_passes_that_prefilled():
    from serving.step_rate import WINDOW, StepRate

    r = StepRate()
    assert r.rate() is None
    r.add(0, 5.0)  # a decode pass or an idle poll: not a prefill
    assert r.rate() is None
    r.add(2048, 0.2)
    r.add(952, 0.1)
    assert r.rate() == pytest.approx(3000 / 0.3)
    for _ in range(WINDOW):  # the window holds the last WINDOW prefilling passes
        r.add(100, 1.0)
    assert r.rate() == pytest.approx(100.0)
    r = StepRate()
    r.passed(0, woke=0.0, busy=False, now=0.5)  # idle until 0.5 s
    r.passed(300, woke=10.0, busy=False, now=10.1)  # woke by a command at 10 s: 0.1 s of work
    r.passed(100, woke=10.1, busy=True, now=10.3)  # the previous pass left work: from its end
    assert r.rate() == pytest.approx(400 / 0.3)


def test_step_rate_skips_a_short_prompt_on_an_idle_node():
    """A warm-up or health check of a few tokens on an idle node times a pass's fixed cost: taken as
    the rate (4 tokens in 40 ms: 100 tokens/s), admission would refuse the first burst after it."""
    from serving.step_rate import StepRate

    r = StepRate()
    r.passed(4, woke=0.0, busy=False, now=0.04)
    assert r.rate() is None  # nothing measured: admission does not refuse on a guess
    r.passed(336, woke=1.0, busy=False, now=1.065)  # a prompt as long as a real one, from idle
    assert r.rate() == pytest.approx(336 / 0.065)
    r.passed(4, woke=1.065, busy=True, now=1.075)  # short passes of a busy node are its work
    assert r.rate() == pytest.approx(340 / 0.075)


def test_the_nodes_own_rate_goes_before_the_routers_measure():
    from proto import pb
    from router.registry import NodeEntry
    from router.wait_estimate import NODE_RATE_MARGIN, node_rate

    m = RateMeter()
    m.busy("p", now=0.0)
    m.done("p", 3000, now=1.0)  # a lone prompt's round trip: 3000 tokens/s seen from the router
    e = NodeEntry(pb.NodeInfo(node_id="p", kind=pb.NODE_KIND_PREFILL))
    assert node_rate(e, m) == pytest.approx(3000.0)  # nothing reported yet: the router's figure
    e.info.prefill_tokens_per_s = 9000.0
    assert node_rate(e, m) == pytest.approx(9000.0 * NODE_RATE_MARGIN)
    assert node_rate(NodeEntry(pb.NodeInfo(node_id="q")), m) is None  # neither


def test_the_prefill_cost_is_fitted_to_tokens_and_context():
    """A node's passes timed by a known cost (a per token, b per attended pair): the chunks of one
    long prompt (contexts 0 to 30k) give back a and b; passes alike in context give one rate
    (b 0, a the window's seconds over its tokens)."""
    from serving.step_rate import StepRate

    def pairs(start: int, n: int) -> int:  # token i sees start + i + 1 positions
        return sum(start + i + 1 for i in range(n))

    a, b, chunk = 2e-4, 4e-8, 2048
    r, now = StepRate(), 0.0
    assert r.cost() is None
    for start in range(0, 32768, chunk):  # one 32k prompt, chunked; the first pass from idle
        now += a * chunk + b * pairs(start, chunk)
        r.passed(chunk, woke=0.0, busy=start > 0, now=now, pairs=pairs(start, chunk))
    fa, fb, fastest = r.cost()
    assert (fa, fb) == (pytest.approx(a, rel=1e-6), pytest.approx(b, rel=1e-6))
    assert fastest == pytest.approx(a + b * pairs(0, chunk) / chunk)  # the first chunk, context 0 to 2k
    r, now = StepRate(), 0.0
    for i in range(8):  # 3k prompts alone
        now += 0.5
        r.passed(3000, woke=0.0, busy=i > 0, now=now, pairs=pairs(0, 3000))
    assert r.cost() == (pytest.approx(0.5 / 3000), 0.0, pytest.approx(0.5 / 3000)) and r.rate() == pytest.approx(6000.0)


def test_a_placed_request_is_expected_to_end_at_a_typical_length():
    """A placed request's tokens left are the recent requests' mean output within its own limit, not
    the limit: one without max_tokens may run to the context's end, and counted at that a burst of
    24 requests against 16 slots that was done in 24 s was estimated 30 s to 170 s and refused."""
    from router.wait_estimate import LENGTHS_WINDOW, OUTPUT_PRIOR_TOKENS, OutputLengths

    lengths = OutputLengths()
    assert lengths.left(0, 8000) == OUTPUT_PRIOR_TOKENS  # nothing ended yet: a chat answer's length
    assert lengths.left(0, 16) == 16  # its own limit is nearer
    lengths.ended(0)  # ended before any token (refused, failed): says nothing of lengths
    for n in (100, 300, 200):
        lengths.ended(n)
    assert lengths.left(0, 8000) == 200
    assert lengths.left(150, 8000) == 200  # past part of it: another mean to go, as good a guess as any
    assert lengths.left(7950, 8000) == 50
    assert lengths.left(8000, 8000) == 0
    assert lengths.left(10, 8000, least=8000) == 7990  # only its limit ends it (ignore_eos, no stops)
    assert lengths.left(10, 8000, least=500) == 490  # min_tokens past the typical length
    assert lengths.left(10, 8000, least=50) == 200
    for _ in range(LENGTHS_WINDOW):  # the window holds the last LENGTHS_WINDOW ends
        lengths.ended(40)
    assert lengths.left(0, 8000) == 40


def test_a_prefill_node_is_counted_the_prompt_less_what_it_has_cached():
    """The prompt tokens counted against a prefill node (its window, admission's estimate) are what
    it will compute: a conversation's next turn sent where its history is cached counts its new
    tokens, not the whole history again (counted in full, agents' long shared system prompts had
    the estimate err long by the size of their prefix per request, and refuse them). Given back,
    the node's count returns to nothing."""
    from proto import pb
    from router.config import RouterConfig
    from router.policy import make_policy
    from router.prefill import PrefillPhase
    from router.prefix import PrefixQuery
    from router.registry import NodeRegistry

    reg = NodeRegistry()
    d = reg.register(pb.NodeInfo(node_id="d", kind=pb.NODE_KIND_DECODE))
    p = reg.register(pb.NodeInfo(node_id="p", kind=pb.NODE_KIND_PREFILL, prefill_ready=True))
    p.cache.block_size = 16
    phase = PrefillPhase(RouterConfig(), reg, make_policy("cache-aware"), spawn=lambda c: c.close())
    first = list(range(100, 164))  # 64 tokens: 4 full pages
    q1 = PrefixQuery(first)
    p1, n1 = phase.choose(d, len(first), set(), window=True, q=q1)
    assert (p1, n1) == (p, 64) and p.inflight_interactive_tokens == 64  # nothing cached yet
    p.cache.remember(q1, compute=True, ttl_s=60.0)  # as the router does once it placed the prompt
    turn = first + list(range(500, 540))  # the next turn: the history and 40 new tokens
    p2, n2 = phase.choose(d, len(turn), set(), window=True, q=PrefixQuery(turn))
    assert (p2, n2) == (p, len(turn) - 64) and p.inflight_interactive_tokens == 64 + 40
    phase._given_back(p, "r1", n1, ok=True, batch=False)
    phase._given_back(p, "r2", n2, ok=True, batch=False)
    assert p.inflight_interactive_tokens == p.inflight_prefill_tokens == 0
    other = list(range(900, 964))  # a prompt sharing none of it: counted in full
    assert phase.choose(d, len(other), set(), window=True, q=PrefixQuery(other)) == (p, 64)


def test_a_prefill_calls_deadline_grows_with_its_prompt():
    """--prefill-timeout plus twice the prompt's time at the node's measured rate: a long prompt on
    a slow node is work, not a hang (on a 2-core box a 60,000-token prompt ran past a fixed 120 s
    and the client got 504). Before any rate is known, the timeout alone."""
    from proto import pb
    from router.config import RouterConfig
    from router.policy import make_policy
    from router.prefill import PREFILL_DEADLINE_MARGIN, PrefillPhase
    from router.registry import NodeRegistry
    from router.wait_estimate import NODE_RATE_MARGIN

    reg = NodeRegistry()
    p = reg.register(pb.NodeInfo(node_id="p", kind=pb.NODE_KIND_PREFILL, prefill_ready=True))
    cfg = RouterConfig()
    phase = PrefillPhase(cfg, reg, make_policy("cache-aware"), spawn=lambda c: c.close())
    assert phase.deadline_s(p, 60_000) == cfg.prefill_timeout_s  # nothing measured yet
    p.info.prefill_tokens_per_s = 500.0
    rate = 500.0 * NODE_RATE_MARGIN
    assert phase.deadline_s(p, 60_000) == pytest.approx(cfg.prefill_timeout_s + PREFILL_DEADLINE_MARGIN * 60_000 / rate)
    assert phase.deadline_s(p, 100) == pytest.approx(cfg.prefill_timeout_s + PREFILL_DEADLINE_MARGIN * 100 / rate)
    a, b = 2e-4, 4e-8  # a fitted cost: the prompt's time at its own length (its context grows as it goes)
    p.info.prefill_cost.CopyFrom(pb.PrefillCost(s_per_token=a, s_per_pair=b))
    took = 60_000 * (a + b * 60_001 / 2) / NODE_RATE_MARGIN
    assert phase.deadline_s(p, 60_000) == pytest.approx(cfg.prefill_timeout_s + PREFILL_DEADLINE_MARGIN * took)


async def _alone_passes_a_decode_bound_head():
    adm = Admission(max_queued=0)
    decode, window = _Room(), _Room()  # free decode places, free places in the prefill window
    order: list[str] = []

    def needs_both(name: str):
        def fn():
            if decode.n == 0:
                adm.blocked(on_decode=True)
                return None
            if window.n == 0:
                adm.blocked(on_decode=False)
                return None
            decode.n, window.n = decode.n - 1, window.n - 1
            order.append(name)
            return name

        return fn

    def needs_window(name: str):
        def fn():
            if window.n == 0:
                adm.blocked(on_decode=False)
                return None
            window.n -= 1
            order.append(name)
            return name

        return fn

    tasks = {}

    async def arrive(name: str, alone: bool) -> None:
        place = needs_window(name) if alone else needs_both(name)
        tasks[name] = asyncio.create_task(adm.wait(Ask(alone=alone), place, _never))
        await asyncio.sleep(0.01)  # it has tried once (and may be placed already)

    window.n = 1
    await arrive("head", False)  # no decode room: it waits for it
    await arrive("one", True)  # needs no decode room: placed past the head, in the free window place
    assert await asyncio.wait_for(tasks["one"], 2) == "one" and not tasks["head"].done()
    await arrive("two", True)  # the window is full now: it waits, like everyone
    await asyncio.sleep(0.05)
    assert not tasks["two"].done()
    decode.n = 1  # decode room: the head now waits for the window only, so "two" keeps its turn
    adm.wake()
    await asyncio.sleep(0.05)
    window.n = 1
    adm.wake()
    assert await asyncio.wait_for(tasks["head"], 2) == "head"
    window.n = 1
    adm.wake()
    assert await asyncio.wait_for(tasks["two"], 2) == "two"
    assert order == ["one", "head", "two"] and adm.depth() == 0


def test_a_first_token_only_request_passes_a_head_waiting_for_decode_room():
    """FIFO has one exception: while the head waits for decode room, a request that needs none
    (it ends at its first token) is placed from behind it if a prefill node's window has room;
    while the head waits for the window itself, it keeps its turn."""
    asyncio.run(_alone_passes_a_decode_bound_head())
