"""Short prompts on a decode node (SchedulerConfig.short_prompt_tokens / short_step_tokens, set
from `pdserve decode --local-prefill-step-tokens`): a burst of them is spread over steps, each
prompt whole, at most the cap a step altogether, while decode rows and longer prompts go on. The
plan of each step is checked row by row, worked out by hand."""

from __future__ import annotations

from engine.cache.block_manager import BlockManager, SlotPool
from engine.config import SchedulerConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def make(short: int = 40, cap: int = 24) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, short_prompt_tokens=short, short_step_tokens=cap)
    return Scheduler(cfg, BlockManager(256, 4), SlotPool(8), 1000)


def req(rid: str, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s: Scheduler) -> list[tuple[str, int]]:
    out = s.schedule()
    s.update(out, {r.request.request_id: [7] for r in out.rows if r.samples}, ())
    return sorted((r.request.request_id, r.num_new_tokens) for r in out.rows)


def test_a_burst_of_short_prompts_is_spread_whole_over_steps():
    s = make()
    for rid, n in (("a", 10), ("b", 10), ("c", 10), ("long", 100), ("d", 4), ("e", 5)):
        s.add(req(rid, n))
    # a and b fit the cap of 24; c (10 more) does not: it waits whole, the long prompt goes on,
    # d (4) still fits after it, e (5) not
    assert step(s) == [("a", 10), ("b", 10), ("d", 4), ("long", 100)]
    assert step(s) == [("a", 1), ("b", 1), ("c", 10), ("d", 1), ("e", 5), ("long", 1)]


def test_a_short_prompt_longer_than_the_cap_is_chunked_at_it():
    s = make(short=40, cap=24)
    s.add(req("a", 30))
    assert step(s) == [("a", 24)]
    assert step(s) == [("a", 6)]


def test_no_cap_without_short_prompt_tokens():
    s = make(short=0)
    for rid in "abc":
        s.add(req(rid, 10))
    assert step(s) == [("a", 10), ("b", 10), ("c", 10)]


def test_no_cap_while_inactive_and_a_capped_prompt_goes_on_after():
    """A decode node without a prefill pool (`short_active` False, from the router's heartbeat)
    computes short prompts as any; one admitted under the cap finishes its prompt once it is off."""
    s = make(short=40, cap=24)
    s.add(req("a", 30))
    assert step(s) == [("a", 24)]
    s.short_active = False
    for rid in "bc":
        s.add(req(rid, 10))
    assert step(s) == [("a", 6), ("b", 10), ("c", 10)]
